"""Primary and standby: the two roles a coordinator starts in, over the same parts.

Everything else — lifecycle (server.py), planning (coordinator/planning.py), ranks and sending
(serve/), workers (pool/workforce.py), checkpoints (checkpoint/positions.py), the lease once held
(ha/tenure.py) — is one code for both; a role says only what differs:

- a **primary** starts from step 0 or its --resume folder, takes the first lease of its
  checkpoint folder once it listens, and moves the job to the position the first rank brings;
- a **standby** (`--standby`, ha/following.py) announces the address it will listen on, follows
  the primary's lease before any worker, thread or loop exists, and once the folder holds a
  snapshot replays it and plans along the primary's delta log (`follow`) until it takes over.
  Then it serves as "promoted": the folder's position starts the job, and each rank goes on
  from its own position, which must be the one this coordinator plans for that step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

from omniload.coordinator.checkpoint.folder import Recovery, last_position, log_after
from omniload.coordinator.ha.following import Follower, follow, warm_forkserver
from omniload.coordinator.ha.lease import job_digest
from omniload.coordinator.plan.requests import Cancelled
from omniload.coordinator.serve.delivery import Delivery
from omniload.coordinator.serve.listening import reachable, reserve
from omniload.errors import ConfigError, OmniloadError
from omniload.formats.ring import remove_stale_segments

if TYPE_CHECKING:
    from omniload.coordinator.checkpoint.positions import Positions
    from omniload.coordinator.ha.tenure import Tenure
    from omniload.coordinator.planning import Planning
    from omniload.spec import Spec

log = logging.getLogger("omniload")
_FOLLOW_S = 0.05  # how often a hot standby looks at the lease and the log


class RoleJob(Protocol):
    """What a role needs of its job: the parts of server.py's Coordinator it uses, and no more."""

    spec: Spec
    token: bytes
    host: str
    port: int
    reserved: socket.socket | None
    parent: int | None
    exit_code: int
    should_exit: asyncio.Event
    announce: Callable[[str, str | None], None]
    tenure: Tenure
    positions: Positions
    planning: Planning

    def fail(self, where: str, exc: BaseException) -> None: ...


class Primary:
    name = "primary"  # in WELCOME
    repositions = True  # the position the first rank brings moves the job there

    def __init__(self, job: RoleJob) -> None:
        self._job = job

    def wait_for_turn(self) -> int | None:
        """A primary's turn is now."""
        return None

    def recover(self) -> Recovery | None:
        """Where the job starts: the --resume folder's last consistent position, if any."""
        return self._job.positions.read_resume_folder()

    async def follow(self, recovery: Recovery | None) -> bool:
        return True

    def replaying(self) -> str:
        return "resuming"

    async def hold_lease(self, addr: str) -> bool:
        """The first primary takes a lease in its checkpoint folder; False if it lost it meanwhile."""
        spec, tenure = self._job.spec, self._job.tenure
        folder = spec.checkpoint_dir or spec.resume
        if folder and not tenure.held:
            await tenure.take_first(folder, addr)
        return tenure.still_held()

    def takes_over(self, brought: dict | None, at: int, slowest: int) -> bool:
        """Whether a rank that brings `brought` (at step `at`) goes on from its own position."""
        return False

    def check_brought(self, at: int, brought: dict, delivery: Delivery) -> None:
        """Only a promoted standby checks the positions the ranks bring (`takes_over`)."""

    def check_planned(self, number: int, position: dict) -> bool:
        """Every planned step is delivered."""
        return True


class Standby:
    name = "promoted"  # in WELCOME, once it serves
    repositions = False  # after a takeover the folder's position starts the job

    def __init__(self, job: RoleJob) -> None:
        self._job = job
        self._follower: Follower | None = None
        self._brought: dict[int, dict] = {}  # after a takeover: step -> a position a rank brought, to check

    def wait_for_turn(self) -> int | None:
        """Before any worker, thread or loop: announce the address ranks will find this
        coordinator at, and follow the lease until the primary has written a snapshot (then
        `follow` goes on with workers running), this one takes over (cold: the primary died
        before any snapshot), or the job ends (its exit code)."""
        job = self._job
        folder = job.spec.checkpoint_dir
        if not folder:
            raise ConfigError(
                "a standby coordinator needs --checkpoint-dir: the primary's folder, whose lease "
                "and delta log it follows"
            )
        os.makedirs(folder, exist_ok=True)
        job.reserved = reserve(job.host, job.port, "--port")  # the announced port, ours until the takeover
        job.port = job.reserved.getsockname()[1]
        addr = f"{reachable(job.host)}:{job.port}"
        warm_forkserver()
        job.announce(addr, None)
        self._follower = Follower(folder, job_digest(job.token.decode()), addr)
        turn = follow(self._follower, job.parent, until_snapshot=True)
        if turn.code is not None:
            return turn.code
        if not turn.hot:
            self._take_over(turn.epoch)
        return None

    def recover(self) -> Recovery | None:
        """The folder's last consumed position, where a standby starts (hot, or at a cold
        takeover): no rank has consumed less, so every rank's own position is at or after it
        (read before the loop starts)."""
        folder = self._job.spec.checkpoint_dir
        assert folder is not None  # a standby needs the folder (the spec says so)
        found = last_position(folder)
        if found is None:
            log.warning("the primary left no checkpoint in %s yet; planning from the job's start", folder)
            return None
        self._job.positions.check_same_data({**found.state, "step": found.step}, f"checkpoint in {folder}", found.job)
        return found

    async def follow(self, recovery: Recovery | None) -> bool:
        """As a standby whose workers run: plan along, without building, as the primary's log
        grows, so that a takeover costs only the steps logged since the last look. True once
        this one is the primary (at once after a cold takeover); False when the job ended or
        this one is stopping."""
        job = self._job
        if job.tenure.held:
            return True
        follower = cast(Follower, self._follower)  # followed hot: from a snapshot
        loop, planning = asyncio.get_running_loop(), job.planning
        base = cast(Recovery, recovery).state["step"]
        while not job.should_exit.is_set():
            if job.parent is not None and os.getppid() != job.parent:
                log.error("the launching process is gone; the standby exits")
                job.exit_code = 1
                break
            turn = await loop.run_in_executor(None, follower.look)
            if turn is not None and turn.code is not None:
                job.exit_code = turn.code
                break
            started, before = time.monotonic(), planning.stepper.step
            try:
                await loop.run_in_executor(None, self._catch_up, base)
            except Cancelled:
                return False
            if turn is not None:
                await loop.run_in_executor(None, self._take_over, turn.epoch)
                planning.start_position = planning.state_dict()
                log.warning(
                    "took over at step %d: caught up %d steps in %.2fs (a hot standby)",
                    planning.stepper.step,
                    planning.stepper.step - before,
                    time.monotonic() - started,
                )
                return True
            try:
                async with asyncio.timeout(_FOLLOW_S):
                    await job.should_exit.wait()
            except TimeoutError:
                pass
        job.should_exit.set()
        return False

    def replaying(self) -> str:
        return "resuming" if self._job.tenure.held else "a standby follows"

    async def hold_lease(self, addr: str) -> bool:
        """A promoted standby holds the lease since its takeover; False if it lost it meanwhile."""
        return self._job.tenure.still_held()

    def takes_over(self, brought: dict | None, at: int, slowest: int) -> bool:
        """A promoted standby starts at the folder's position; each rank goes on from its own."""
        return brought is not None and at >= slowest

    def check_brought(self, at: int, brought: dict, delivery: Delivery) -> None:
        """After a takeover, a rank's own position must be the one this coordinator plans for
        that step (now, or when the planner gets there): else the folder and the ranks disagree."""
        planned = delivery.positions.get(at)
        if planned is None:
            self._brought.setdefault(at, brought)
        elif planned != brought:
            raise OmniloadError(
                f"a rank brings a loader position for step {at} that differs from the one this "
                f"coordinator planned from {self._job.spec.checkpoint_dir}: the ranks and the "
                "checkpoint folder are not of the same run (restore the ranks and the folder together)"
            )

    def check_planned(self, number: int, position: dict) -> bool:
        """A planned step whose position a rank brought must be that one; else the job fails."""
        expected = self._brought.pop(number + 1, None) if self._brought else None
        if expected is not None and expected != position:
            self._job.fail(
                "the takeover",
                OmniloadError(
                    f"a rank brought a loader position for step {number + 1} that differs from the one this "
                    "coordinator "
                    f"planned from {self._job.spec.checkpoint_dir}: the ranks and the checkpoint folder are not of the "
                    "same run"
                ),
            )
            return False
        return True

    def _take_over(self, epoch: int) -> None:
        """This standby holds the lease of `epoch` now: renew it, and remove the dead primary's rings."""
        assert self._job.spec.checkpoint_dir is not None
        self._job.tenure.hold(self._job.spec.checkpoint_dir, epoch)
        for path in remove_stale_segments():
            log.info("removed %s, left by the primary that died", path.name)

    def _catch_up(self, base: int) -> None:
        """Plan (not build) up to the last step the folder says every rank consumed, with the
        live mixture changes recorded since snapshot `base`. On a thread."""
        assert self._job.spec.checkpoint_dir is not None
        step, live = log_after(self._job.spec.checkpoint_dir, base)
        stepper = self._job.planning.stepper
        known = stepper.live_changes
        for at, weights in live:
            if (at, weights) not in known:
                known.append((at, weights))
        while stepper.step < step and stepper.next_step(build=False) is not None:
            pass
