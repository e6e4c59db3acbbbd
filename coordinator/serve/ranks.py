"""The job's ranks, as the sessions' Hub (serve/sessions.py): who may connect, where each
starts, what its ACKs move, and what the waiting ranks are told.

The first rank's HELLO fixes the world: the layout, which ranks connect and the kind of frame
each gets; a position it brings moves the job there before any step is planned (a primary's;
after a takeover each rank goes on from its own, ha/roles.py). An admitted rank is sent WELCOME
and then the frames it has credit for (serve/delivery.py); the first one starts the planner.
When the slowest rank moves, the planner may plan further, the step arena frees the bytes
every rank has read, and the position is checkpointed. On the tick, `watch` tells the waiting
ranks which rank they wait for, and past --rank-timeout stops the job. When the job stops,
`hang_up` gives the ranks a moment to read the last frames.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Protocol

from omniload.coordinator.plan.stepper import Step
from omniload.coordinator.serve.delivery import Delivery, Frames, RankState, Variant
from omniload.coordinator.serve.routed_sessions import Writer
from omniload.coordinator.serve.sessions import Refused
from omniload.errors import ConfigError, OmniloadError
from omniload.layout import Layout
from omniload.protocol import Hello, Kind, Message, encode
from omniload.spec import check_weights
from omniload.state import check_state

if TYPE_CHECKING:
    from omniload.coordinator.checkpoint.positions import Positions
    from omniload.coordinator.ha.roles import Primary, Standby
    from omniload.coordinator.ha.tenure import Tenure
    from omniload.coordinator.observe.figures import Figures
    from omniload.coordinator.planning import Planning
    from omniload.coordinator.pool.workforce import Workforce
    from omniload.coordinator.serve.dispatch import Dispatch
    from omniload.spec import Spec

log = logging.getLogger("omniload")
_NOTE_EVERY_S = 30.0  # how often waiting ranks hear what they wait for (at most)
_HANG_UP_S = 2.0  # how long ranks get to read the last frames and hang up when the job stops


class RanksJob(Protocol):
    """What the ranks' hub needs of its job: the parts of server.py's Coordinator it uses, and no more."""

    spec: Spec
    token: bytes
    job_id: str
    source_names: list[str]
    role: Primary | Standby
    tenure: Tenure
    positions: Positions
    planning: Planning
    workforce: Workforce
    dispatch: Dispatch
    figures: Figures
    should_exit: asyncio.Event

    def fail(self, where: str, exc: BaseException) -> None: ...

    def task_ended(self, task: asyncio.Task[None], where: str) -> None: ...


class Ranks:
    def __init__(self, job: RanksJob) -> None:
        """On the loop, once the job's parts before it exist (server.py's `_main`)."""
        self._job = job
        self._spec = job.spec
        self.token = job.token
        self.layout: Layout | None = None
        self.variants: dict[int, Variant] = {}  # the ranks that connect, with the frame each gets
        self.frame_kinds: list[Variant] = []  # one frame of each per step
        self.delivery: Delivery | None = None
        self.stall_message: str | None = None  # what the ranks wait for now, if they wait for a rank
        self._last_note = 0.0
        self._admission = asyncio.Lock()

    @property
    def live(self) -> Delivery:
        """The delivery, which exists once the first rank said HELLO (every caller comes after)."""
        assert self.delivery is not None, "no rank has connected yet"
        return self.delivery

    @property
    def grid(self) -> Layout:
        """The layout, fixed by the first rank's HELLO (every caller comes after)."""
        assert self.layout is not None, "no rank has connected yet"
        return self.layout

    # -- the Hub of sessions.py --------------------------------------------------------------
    async def admit(self, hello: Hello, writer: Writer) -> RankState:
        """Register a rank from its HELLO and send WELCOME; raises Refused (and fails the job
        when the ranks disagree on the job itself)."""
        job, planning, plan_ahead = self._job, self._job.planning, self._spec.plan_ahead
        async with self._admission:  # one at a time: the first may move the whole job
            if job.tenure.fenced:  # the rank tries the next address: the new primary's
                raise Refused(f"this coordinator lost its lease: {job.tenure.fenced}")
            try:
                brought = self._check_hello(hello)
            except ConfigError as exc:
                self.fail(f"rank {hello.rank}'s HELLO", exc)
                raise Refused(str(exc)) from None
            rank, delivery = hello.rank, self.delivery
            if rank not in self.variants:
                raise Refused(
                    f"rank {rank} should not connect: with broadcast_at=tp only tp rank 0 of each group "
                    "connects (use omniload.connect(broadcast_at='tp') on every rank)"
                )
            if (
                delivery is None
                and brought is not None
                and brought["step"] != planning.start_position["step"]
                and job.role.repositions
            ):
                await planning.reposition(brought, job.workforce)
            if self.delivery is None:
                self.delivery = Delivery(self.variants, planning.start_position, self._consumed)
            delivery = self.delivery
            state = delivery.ranks[rank]
            if state.writer is not None:
                raise Refused(f"rank {rank} is already connected")
            at = delivery.consumed(rank) if brought is None else brought["step"]
            taken_over = job.role.takes_over(brought, at, delivery.slowest)
            if (
                not taken_over
                and at != delivery.consumed(rank)
                and (at not in delivery.positions or at < delivery.slowest)
            ):
                message = (
                    f"rank {rank} brings the loader position of step {at}, but this job is at step "
                    f"{delivery.consumed(rank)}: restore the same checkpoint step on every rank"
                )
                if not planning.started:
                    self.fail(f"rank {rank}'s HELLO", ConfigError(message))
                raise Refused(message)
            if taken_over:
                assert brought is not None  # only a rank that brings a position takes over
                try:
                    job.role.check_brought(at, brought, delivery)
                except OmniloadError as exc:
                    self.fail(f"rank {rank}'s HELLO", exc)
                    raise Refused(str(exc)) from None
            state = delivery.attach(rank, writer, hello.credits, at)
            writer.write(encode(Message(Kind.WELCOME, self._welcome(state, at, brought))))
            if taken_over and planning.started:  # attach may have moved the slowest rank
                planning.allow(delivery.slowest + plan_ahead)
            delivery.pump(state)
            if not planning.started:
                planning.start(
                    self.grid.dp, delivery.slowest + plan_ahead, lambda task: job.task_ended(task, "the planner")
                )
            return state

    def acknowledge(self, state: RankState, step: int) -> None:
        delivery = self.live
        before = delivery.slowest
        delivery.acknowledge(state, step)
        if delivery.slowest != before:
            self._job.planning.allow(delivery.slowest + self._spec.plan_ahead)
            self._job.dispatch.release_through(delivery.slowest - 1)  # every rank has read these steps' bytes

    def rank_gone(self, state: RankState) -> None:
        self.live.detach(state)
        if self._job.should_exit.is_set() or state.ended:
            pass
        elif state.said_bye:
            log.info("rank %d closed its loader after consuming %d steps", state.rank, self.live.consumed(state.rank))
        else:
            log.warning(
                "rank %d disconnected without saying goodbye after consuming %d steps; the job waits for "
                "it to reconnect (--rank-timeout %gs)",
                state.rank,
                self.live.consumed(state.rank),
                self._spec.rank_timeout,
            )
        if self.live.finished():
            log.info("every rank has its data; exiting")
            self._job.should_exit.set()

    def status(self) -> dict[str, Any]:
        """The job's figures now (`omniload status`, the metrics endpoint, launch's progress)."""
        return self._job.figures.snapshot(self.delivery, self.stall_message)

    async def change_weights(self, weights: Any) -> int:
        """`omniload mix`: the step the new weights take effect at, exactly (the planner applies
        them between two steps)."""
        checked = self._check_weights(weights)
        step = await self._job.planning.planner.change_weights(checked)
        log.info("mixture changed from step %d on: %s", step, checked)
        return step

    def fail(self, where: str, exc: BaseException) -> None:
        self._job.fail(where, exc)

    # -- the planner's steps -----------------------------------------------------------------
    def encode_step(self, step: Step, position: dict) -> Frames:
        """The step's frames, one per kind of rank (pure: it may run on the planner's thread)."""
        return self._job.dispatch.encode_step(step, position, self.grid.dp, self.frame_kinds)

    def on_step(self, number: int, frames: Frames, position: dict, tokens: int) -> None:
        if not self._job.role.check_planned(number, position):
            return
        self._job.dispatch.planned(frames)
        self.live.add_step(number, frames, position, tokens)

    def on_end(self, steps: int) -> None:
        log.info("data ended after %d steps", steps)
        self.live.end(steps)

    # -- the watch and the end -----------------------------------------------------------------
    def unconnected(self) -> list[int]:
        """The ranks that have never connected."""
        return sorted(r for r, s in self.live.ranks.items() if not s.seen)

    def watch(self, now: float) -> None:
        """Tell the waiting ranks which rank they wait for; past --rank-timeout, stop the job."""
        stall = self.live.stall(self._spec.plan_ahead, now)
        timeout = self._spec.rank_timeout
        self.stall_message = message = stall.describe(self._spec.plan_ahead, timeout) if stall else None
        if stall is None:
            return
        # a rank that never connected may be slow to start (imports, a late node): told, not timed out
        if timeout and stall.silent_s >= timeout and stall.connection != "never":
            self.fail("the rank watch", OmniloadError(f"stopping the job: {message}"))
            return
        every = min(_NOTE_EVERY_S, timeout / 4) if timeout else _NOTE_EVERY_S
        if stall.silent_s >= every and now - self._last_note >= every:
            self._last_note = now
            log.warning("%s", message)
            note = encode(Message(Kind.WAIT, {"message": message}))
            for rank in stall.waiting:
                writer = self.live.ranks[rank].writer
                if writer is not None:
                    writer.write(note)

    def tell_all(self, message: Message) -> None:
        if self.delivery:
            self.live.tell_all(message)

    async def hang_up(self) -> None:
        """Half-close every rank's connection and give the ranks a moment to read what was sent
        (an ERROR above all) and hang up: closing with their ACKs unread would reset the
        connection, and the reset would throw away the ERROR they had not read yet."""
        if self.delivery is None:
            return
        ranks = self.live.ranks.values()
        for state in ranks:
            if state.writer is not None and not state.writer.is_closing() and state.writer.can_write_eof():
                state.writer.write_eof()
        deadline = time.monotonic() + _HANG_UP_S
        while any(state.writer is not None for state in ranks) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for state in ranks:
            if state.writer is not None:
                state.writer.close()

    # -- helpers -----------------------------------------------------------------------------
    def _check_hello(self, hello: Hello) -> dict | None:
        """Learn the world from the first rank; check the others agree. The position it brings."""
        if self.layout is None:
            self.layout = Layout(
                world=hello.world_size,
                tp=self._spec.tp,
                pp=self._spec.pp,
                cp=self._spec.cp,
                order=self._spec.rank_order,
            )
            connecting = [r for r in range(hello.world_size) if self.grid.connects(r, self._spec.broadcast_at)]
            self.variants = {r: self._variant(r) for r in connecting}
            self.frame_kinds = sorted(set(self.variants.values()))
        elif hello.world_size != self.grid.world:
            raise ConfigError(
                f"rank {hello.rank} says the world has {hello.world_size} ranks; earlier ranks said {self.grid.world}"
            )
        if hello.resume is None:
            return None
        brought = check_state(hello.resume, f"rank {hello.rank}'s loader state")
        self._job.positions.check_same_data(brought, f"loader state rank {hello.rank} brought")
        return brought

    def _variant(self, rank: int) -> Variant:
        coords = self.grid.coords(rank)
        return coords["dp"], coords["cp"], self.grid.needs_data(rank, self._spec.pp_data)

    def _welcome(self, state: RankState, at: int, brought: dict | None = None) -> dict:
        """pid, host, role ("primary", or "promoted" for a standby that took over) and epoch name
        the serving coordinator (for logs, tests, and the rank's refusal of an older epoch)."""
        job, spec = self._job, self._spec
        return {
            "job": job.job_id,
            "fingerprint": job.positions.fingerprint,
            "dp": self.grid.dp,
            "dp_rank": state.variant[0],
            "seq_len": spec.seq_len,
            "rows": spec.rows,
            "resume_step": at,
            "sources": job.source_names,
            "broadcast_at": spec.broadcast_at,
            "state": self.live.positions.get(at, brought),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "epoch": job.tenure.epoch,
            "role": job.role.name,
            "layout": {
                "world": self.grid.world,
                "tp": spec.tp,
                "pp": spec.pp,
                "cp": spec.cp,
                "order": spec.rank_order,
            },
        }

    def _consumed(self, position: dict) -> None:
        """Every rank has consumed the steps before this position: checkpoint it."""
        self._job.positions.consumed(position, self.grid.dp)

    def _check_weights(self, weights: object) -> dict[str, float]:
        return check_weights(weights, "new weights", self._job.source_names)
