"""The coordinator: one asyncio process per job. Its lifecycle, admission of ranks, one failure path.

It reads top to bottom: index sources and fork the worker pool (before the loop) -> replay a
--resume folder (off the loop) -> bind and announce -> serve ranks while the planner plans
ahead of the slowest rank and a tick watches the job -> shut down (stop the planner,
close connections, stop workers, unlink rings). A second Ctrl-C forces the exit. A standby
(ha/standby.py) announces first, follows the primary's lease, and once there is a snapshot
replays it and plans along the primary's delta log (`_follow_hot`) until it takes over and
binds; a primary that loses its lease is fenced (`_fence`) and exits with FENCED_EXIT.

Who does what: serve/sessions.py speaks the wire, serve/delivery.py sends frames and counts ACKs
(plan/progress.py), plan/plan_loop.py plans (a costly step's computation on a thread), pool/supervision.py
replaces dead workers, and
ha/checkpoint.py writes on a thread. The loop only waits: nothing here blocks on a disk, a join
or a long computation. Every unexpected error, in any task, thread or callback, ends in
`fail`, which names where it happened and tells every rank.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from omniload.errors import ConfigError, OmniloadError
from omniload.job import FENCED_EXIT  # the launcher replaces a coordinator that exits with it
from omniload.layout import Layout
from omniload.protocol import Hello, Kind, Message, encode
from omniload.spec import Spec
from omniload.state import check_state
from omniload.batch_arrays import expand, narrow
from omniload.formats.ring import remove_stale_segments, segment_path

from omniload.coordinator.serve.batch_frames import encode_batch, step_fields
from omniload.coordinator.pool.catalog import build_catalog, fingerprint, job_identity
from omniload.coordinator.ha.checkpoint import CheckpointWriter, Recovery, explain_mismatch, last_position, log_after
from omniload.coordinator.serve.delivery import Delivery, Frame, Frames, RankState, Variant
from omniload.coordinator.observe.figures import Figures
from omniload.coordinator.pool.intake import SourceIntake
from omniload.coordinator.serve.arena import StepArena
from omniload.coordinator.pool.autoscale import initial_plan
from omniload.coordinator.loop import run_loop
from omniload.coordinator.observe.metrics import serve_metrics
from omniload.coordinator.plan.parallel import cp_slice
from omniload.coordinator.plan.plan_loop import Planner
from omniload.coordinator.pool.worker_pool import WorkerPool, available_cpus
from omniload.coordinator.serve.routed_sessions import Writer
from omniload.coordinator.serve.senders import Senders
from omniload.coordinator.serve.sessions import Refused, Sessions
from omniload.coordinator.ha.standby import Follower, LeaseKeeper, follow, take_first_lease, warm_forkserver
from omniload.coordinator.ha.lease import job_digest
from omniload.coordinator.plan.stepper import Cancelled, Step, Stepper
from omniload.coordinator.pool.supervision import Supervisor

log = logging.getLogger("omniload")
_TICK_S = 0.5
_LAG_WARN_S = 1.0  # the loop was blocked this long between two ticks: say so, it is a bug
_CONNECT_WARN_S = 60.0
_NOTE_EVERY_S = 30.0  # how often waiting ranks hear what they wait for (at most)
_ARENA_CAPACITY = 4 << 30  # the step arena's address space; the part a job's steps need is allocated
_ARENA_MIN = 16 << 20
_CAN_SEND = hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")  # senders need Linux
_HANG_UP_S = 2.0  # how long ranks get to read the last frames and hang up when the job stops
_FOLLOW_S = 0.05  # how often a hot standby looks at the lease and the log
_DISK_FIXES = {
    errno.ENOSPC: "free space there or choose another --checkpoint-dir",
    errno.EDQUOT: "raise the disk quota there or choose another --checkpoint-dir",
    errno.EACCES: "let this user write there or choose another --checkpoint-dir",
    errno.EROFS: "the file system is read-only: choose another --checkpoint-dir",
}


class Coordinator:
    def __init__(self, spec: Spec, token: str, host: str = "127.0.0.1", port: int = 0,
                 announce: Callable[[str, str | None], None] = lambda addr, metrics: print(addr),
                 job_id: str | None = None, exit_with_parent: bool = False, standby: bool = False) -> None:
        """`announce(addr, metrics_addr)` is called once ranks can connect (metrics_addr: None
        without --metrics-port); a standby (coordinator/ha/standby.py) announces the address it
        will listen on once it takes over, as soon as it follows the primary."""
        self.spec = spec
        self.token = token.encode()
        self._host, self._port = host, port
        self._announce = announce
        self.job_id = job_id or os.urandom(4).hex()
        self._parent = os.getppid() if exit_with_parent else None
        self._source_names = [s.name for s in spec.sources]
        self._start: dict = {}  # the position the job starts from (a resume's, or step 0's)
        self._layout: Layout | None = None
        self._variants: dict[int, Variant] = {}  # the ranks that connect, with the frame each gets
        self._frame_kinds: list[Variant] = []  # one frame of each per step
        self._delivery: Delivery | None = None
        self._senders: Senders | None = None
        self._arena: StepArena | None = None  # the planned steps' payloads, for the senders
        self._arena_sized = False
        self._planner: Planner | None = None
        self._checkpoints: CheckpointWriter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._note: str | None = None  # said once in the checkpoint log (e.g. allow_changed_data)
        self._last_note = 0.0
        self._stall_message: str | None = None  # what the ranks wait for now, if they wait for a rank
        self._exit_code = 0
        self._standby = standby  # started as a standby: serves only after taking over (standby.py)
        self._epoch = 0  # the lease epoch this coordinator serves under (0: no checkpoint folder, no lease)
        self._lease: LeaseKeeper | None = None
        self._fenced: str | None = None  # why this primary lost its lease, once it has
        self._brought: dict[int, dict] = {}  # after a takeover: step -> a position a rank brought, to check
        self._should_exit: asyncio.Event
        self._admission: asyncio.Lock

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to its end; returns the process exit code. Call with no loop running."""
        for path in remove_stale_segments():
            log.info("removed %s, left by a job that died", path.name)
        catalog = build_catalog(self.spec)
        plan = initial_plan(self.spec.weights(), self.spec.workers, self.spec.reserve_cpus, available_cpus())
        self._identity = job_identity(self.spec, catalog)
        self._fingerprint = fingerprint(self._identity)
        if self._standby:
            code = self._wait_for_turn()
            if code is not None:
                return code
            recovery = self._recover_at_takeover()
        else:
            recovery = self._read_resume_folder()
        self._pool = WorkerPool(self.spec, catalog, plan, self.job_id, os.getpid())
        try:
            self._intakes = [SourceIntake(src, self._pool.source_rings(src.index), self.spec.seed,
                                         self.spec.shard_interleave) for src in catalog]
            self._stepper = Stepper(self.spec, self._intakes)
            if recovery:  # the snapshot now, the steps after it replayed once the loop runs
                self._stepper.restore({**recovery.state, "live": recovery.state["live"] + recovery.live})
            else:
                self._start = self._stepper.export_state(self._fingerprint)
            for worker_id in range(len(plan)):
                self._pool.start(worker_id, lambda source: self._intakes[source].cursor)
            folder = self.spec.checkpoint_dir or self.spec.resume
            if folder:
                self._checkpoints = CheckpointWriter(folder, self.spec.snapshot_every, self.spec.keep_snapshots,
                                                     self._identity, self._checkpoint_failed)
            log.info("job %s: %d sources, %d workers, %d lanes", self.job_id, len(catalog), len(plan),
                     sum(self._pool.lane_counts))
            self._senders = self._spawn_senders()
            run_loop(self._main(recovery))
        finally:
            self._pool.stop()
            if self._senders is not None:
                self._senders.kill()
            if self._arena is not None:
                self._arena.close()
            if self._checkpoints:
                self._checkpoints.close()
            if self._lease:  # once the folder holds the last position: standbys leave
                self._lease.stop(self._exit_code if self._fenced is None else None)
        return self._exit_code

    async def _main(self, recovery: Recovery | None) -> None:
        loop = self._loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._on_loop_error)
        self._should_exit, self._admission = asyncio.Event(), asyncio.Lock()
        self._install_signal_handlers(loop)
        self._supervisor = Supervisor(self._pool, self._intakes, self.spec.max_restarts, self.fail)
        self._supervisor.watch_all()
        self._planner = Planner(self._stepper, self._fingerprint, self._encode_step, self._on_step, self._on_end)
        self._figures = Figures(self.job_id, self._source_names, self._intakes, self._pool, self._planner)
        if recovery and not await self._replay(recovery):
            return
        if self._standby and self._lease is None and not await self._follow_hot(recovery):
            return
        sessions = Sessions(self)
        if self._senders is not None:
            await self._senders.start(sessions.session)
            servers = [self._senders.listen(_bind(self._host, self._port, "--port"), sessions.session)]
        else:
            servers = [await _listen(sessions.serve, self._host, self._port, "--port")]
        if self.spec.metrics_port is not None:
            servers.append(await _listen(serve_metrics(self.status), self._host, self.spec.metrics_port, "--metrics-port"))
        addr, *metrics = [_address_of(server) for server in servers]
        if not await self._hold_lease(addr):
            return
        if metrics:
            log.warning("metrics at http://%s/metrics", metrics[0])
        self._announce(addr, metrics[0] if metrics else None)
        ticker = loop.create_task(self._tick_loop())
        ticker.add_done_callback(lambda task: self._task_ended(task, "the coordinator's watch"))
        try:
            await self._should_exit.wait()
        finally:
            for server in servers:
                server.close()
            ticker.cancel()
            await self._planner.stop()
            await self._hang_up()
            if self._senders is not None:
                await self._senders.stop()
            await self._supervisor.close()
            await asyncio.gather(ticker, return_exceptions=True)

    async def _hang_up(self) -> None:
        """Half-close every rank's connection and give the ranks a moment to read what was sent
        (an ERROR above all) and hang up: closing with their ACKs unread would reset the
        connection, and the reset would throw away the ERROR they had not read yet."""
        if self._delivery is None:
            return
        ranks = self._delivery.ranks.values()
        for state in ranks:
            if state.writer is not None and not state.writer.is_closing() and state.writer.can_write_eof():
                state.writer.write_eof()
        deadline = time.monotonic() + _HANG_UP_S
        while any(state.writer is not None for state in ranks) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for state in ranks:
            if state.writer is not None:
                state.writer.close()

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        signals = 0

        def on_signal(signum: int) -> None:
            nonlocal signals
            signals += 1
            if signals > 1:
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                self._pool.stop()
                os._exit(130)
            log.info("%s: shutting down (again to force)", signal.Signals(signum).name)
            self._exit_code = self._exit_code or 128 + signum
            self._stepper.cancel.set()
            self._should_exit.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)

    # -- the lease: standby, takeover, fencing (standby.py) -----------------------------------
    def _wait_for_turn(self) -> int | None:
        """As a standby, before any worker, thread or loop: announce the address ranks will find
        this coordinator at, and follow the lease until the primary has written a snapshot (then
        `_follow_hot` goes on with workers running), this one takes over (cold: the primary died
        before any snapshot), or the job ends (its exit code)."""
        folder = self.spec.checkpoint_dir
        if not folder:
            raise ConfigError("a standby coordinator needs --checkpoint-dir: the primary's folder, whose lease "
                              "and delta log it follows")
        os.makedirs(folder, exist_ok=True)
        self._port = self._port or _free_port(self._host)
        addr = f"{_reachable(self._host)}:{self._port}"
        warm_forkserver()
        self._announce(addr, None)
        self._follower = Follower(folder, job_digest(self.token.decode()), addr)
        turn = follow(self._follower, self._parent, until_snapshot=True)
        if turn.code is not None:
            return turn.code
        if not turn.hot:
            self._take_over(turn.epoch)
        return None

    def _take_over(self, epoch: int) -> None:
        """This standby holds the lease of `epoch` now: renew it, and remove the dead primary's rings."""
        self._epoch = epoch
        self._lease = LeaseKeeper(self.spec.checkpoint_dir, epoch, self._on_fenced)
        for path in remove_stale_segments():
            log.info("removed %s, left by the primary that died", path.name)

    async def _follow_hot(self, recovery: Recovery) -> bool:
        """As a standby whose workers run: plan along, without building, as the primary's log
        grows, so that a takeover costs only the steps logged since the last look. True once
        this one is the primary; False when the job ended or this one is stopping."""
        loop = asyncio.get_running_loop()
        base = recovery.state["step"]
        while not self._should_exit.is_set():
            if self._parent is not None and os.getppid() != self._parent:
                log.error("the launching process is gone; the standby exits")
                self._exit_code = 1
                break
            turn = await loop.run_in_executor(None, self._follower.look)
            if turn is not None and turn.code is not None:
                self._exit_code = turn.code
                break
            started, before = time.monotonic(), self._stepper.step
            try:
                await loop.run_in_executor(None, self._catch_up, base)
            except Cancelled:
                return False
            if turn is not None:
                await loop.run_in_executor(None, self._take_over, turn.epoch)
                self._start = self._stepper.export_state(self._fingerprint)
                log.warning("took over at step %d: caught up %d steps in %.2fs (a hot standby)", self._stepper.step,
                            self._stepper.step - before, time.monotonic() - started)
                return True
            try:
                async with asyncio.timeout(_FOLLOW_S):
                    await self._should_exit.wait()
            except TimeoutError:
                pass
        self._should_exit.set()
        return False

    def _catch_up(self, base: int) -> None:
        """Plan (not build) up to the last step the folder says every rank consumed, with the
        live mixture changes recorded since snapshot `base`. On a thread."""
        step, live = log_after(self.spec.checkpoint_dir, base)
        known = self._stepper.live_changes
        for at, weights in live:
            if (at, weights) not in known:
                known.append((at, weights))
        while self._stepper.step < step and self._stepper.next_step(build=False) is not None:
            pass

    def _recover_at_takeover(self) -> Recovery | None:
        """The folder's last consumed position, where a standby starts (hot, or at a cold
        takeover): no rank has consumed less, so every rank's own position is at or after it
        (read before the loop starts)."""
        folder = self.spec.checkpoint_dir
        found = last_position(folder)
        if found is None:
            log.warning("the primary left no checkpoint in %s yet; planning from the job's start", folder)
            return None
        self._check_same_data({**found.state, "step": found.step}, f"checkpoint in {folder}", found.job)
        return found

    async def _hold_lease(self, addr: str) -> bool:
        """The first primary takes a lease in its checkpoint folder (a promoted standby holds
        one already); False if this coordinator lost it meanwhile."""
        folder = self.spec.checkpoint_dir or self.spec.resume
        if folder and self._lease is None:
            job = job_digest(self.token.decode())
            self._epoch = await asyncio.get_running_loop().run_in_executor(None, take_first_lease, folder, job, addr)
            self._lease = LeaseKeeper(folder, self._epoch, self._on_fenced)
        if self._fenced:
            self._fence(self._fenced)
            return False
        return True

    def _on_fenced(self, reason: str) -> None:
        """From the lease thread: this primary must stop serving."""
        self._fenced = reason
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._fence, reason)
            except RuntimeError:
                pass  # the loop closed meanwhile: the job is ending anyway

    def _fence(self, reason: str) -> None:
        """Lost the lease: stop serving and writing at once; the ranks move to the new primary."""
        if self._should_exit.is_set():
            return
        log.error("this coordinator (epoch %d) stops serving: %s", self._epoch, reason)
        self._exit_code = FENCED_EXIT
        self._stepper.cancel.set()
        if self._checkpoints:
            self._checkpoints.abandon()
        if self._delivery:
            self._delivery.tell_all(Message(Kind.ERROR, {"message": f"coordinator of epoch {self._epoch} fenced: "
                                                                    f"{reason}", "fenced": True}))
        self._should_exit.set()

    def _check_brought(self, at: int, brought: dict) -> None:
        """After a takeover, a rank's own position must be the one this coordinator plans for
        that step (now, or when the planner gets there): else the folder and the ranks disagree."""
        planned = self._delivery.positions.get(at)
        if planned is None:
            self._brought.setdefault(at, brought)
        elif planned != brought:
            raise OmniloadError(f"a rank brings a loader position for step {at} that differs from the one this "
                                f"coordinator planned from {self.spec.checkpoint_dir}: the ranks and the checkpoint "
                                "folder are not of the same run (restore the ranks and the folder together)")

    # -- the one failure path ---------------------------------------------------------------
    def fail(self, where: str, exc: BaseException) -> None:
        """Stop the job: tell every rank why; exit 2 for bad config and 1 otherwise. On the loop."""
        expected = isinstance(exc, OmniloadError)
        message = str(exc) if expected else (f"internal error in {where}: {type(exc).__name__}: {exc} "
                                             "(a bug in omniload; please report it with this log)")
        if self._should_exit.is_set():
            log.warning("while shutting down, %s: %s", where, message)
            return
        log.error("%s", message, exc_info=None if expected else exc)
        self._exit_code = 2 if isinstance(exc, ConfigError) else 1
        self._stepper.cancel.set()  # a resume's replay, on a thread, stops waiting for records
        if self._delivery:
            self._delivery.tell_all(Message(Kind.ERROR, {"message": message}))
        self._should_exit.set()

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Callbacks and connection handlers that raised: never only logged."""
        self.fail("the event loop", context.get("exception") or RuntimeError(context.get("message")))

    def _task_ended(self, task: asyncio.Task, where: str) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(where, task.exception())

    def _checkpoint_failed(self, exc: BaseException) -> None:
        """From the checkpoint writer's thread: stop the job, naming the folder and what to do."""
        folder = self.spec.checkpoint_dir or self.spec.resume
        if isinstance(exc, OSError):
            fix = _DISK_FIXES.get(exc.errno, "check the folder's disk, or choose another --checkpoint-dir")
            exc = OmniloadError(f"checkpoint folder {folder}: {exc}; {fix}")
        if self._loop is None or self._loop.is_closed():  # no loop yet, or it has already ended
            log.error("checkpoint folder %s: %s", folder, exc)
            return
        self._loop.call_soon_threadsafe(self.fail, "the checkpoint writer", exc)

    # -- positions and checkpoints ------------------------------------------------------------
    def _read_resume_folder(self) -> Recovery | None:
        if not self.spec.resume:
            return None
        found = last_position(self.spec.resume)
        if found is None:
            log.warning("--resume %s holds no checkpoint yet; starting from the beginning", self.spec.resume)
            return None
        self._check_same_data({**found.state, "step": found.step}, f"checkpoint in {self.spec.resume}", found.job)
        return found

    async def _replay(self, recovery: Recovery) -> bool:
        """Plan again the steps from the snapshot to the last consumed one, at the size that
        planned them: planning is a pure function of the position, so they come out the same."""
        started = time.monotonic()

        def replay() -> dict:
            self._stepper.dp = recovery.dp
            self._stepper.rehydrate()
            for _ in range(recovery.replay):
                self._stepper.next_step(build=False)
            return self._stepper.export_state(self._fingerprint)

        try:
            self._start = await asyncio.get_running_loop().run_in_executor(None, replay)
        except Cancelled:
            return False  # the job is stopping (Ctrl-C, or a failure) before it started
        except Exception as exc:
            self.fail("the resume", exc)
            return False
        log.warning("%s from %s at step %d, its last consistent step (snapshot of step %d, %d steps "
                    "replayed in %.2fs)", "a standby follows" if self._standby and self._lease is None else "resuming",
                    self.spec.resume or self.spec.checkpoint_dir, recovery.step,
                    recovery.state["step"], recovery.replay,
                    time.monotonic() - started)
        return True

    def _check_same_data(self, state: dict, where: str, saved_job: dict | None = None) -> None:
        if state["fingerprint"] == self._fingerprint:
            return
        what = explain_mismatch(saved_job or {}, self._identity)
        if not self.spec.allow_changed_data:
            raise ConfigError(f"the spec or files differ from the {where}:\n{what}\n checkpoint fingerprint: "
                              f"{state['fingerprint']}\n job fingerprint: {self._fingerprint}\n"
                              "resume with the same spec and files, or pass --allow-changed-data")
        log.warning("the data differs from the %s (--allow-changed-data):\n%s", where, what)
        self._note = f"allow_changed_data: resumed at step {state['step']} over changed data:\n{what}"

    def _on_consumed(self, position: dict) -> None:
        """Every rank has consumed the steps before this position: checkpoint it."""
        if self._checkpoints is not None:
            self._checkpoints.write(position, self._layout.dp, self._note)
            self._note = None

    # -- ranks (the Hub of sessions.py) -----------------------------------------------------
    async def admit(self, hello: Hello, writer: Writer) -> RankState:
        """Register a rank from its HELLO and send WELCOME; raises Refused (and fails the job
        when the ranks disagree on the job itself)."""
        async with self._admission:  # one at a time: the first may move the whole job
            if self._fenced:  # the rank tries the next address: the new primary's
                raise Refused(f"this coordinator lost its lease: {self._fenced}")
            try:
                brought = self._check_hello(hello)
            except ConfigError as exc:
                self.fail(f"rank {hello.rank}'s HELLO", exc)
                raise Refused(str(exc)) from None
            rank, delivery = hello.rank, self._delivery
            if rank not in self._variants:
                raise Refused(f"rank {rank} should not connect: with broadcast_at=tp only tp rank 0 of each group "
                              "connects (use omniload.connect(broadcast_at='tp') on every rank)")
            if delivery is None and brought is not None and brought["step"] != self._start["step"] \
                    and not self._standby:  # after a takeover the folder's position starts the job
                await self._reposition(brought)
            if self._delivery is None:
                self._delivery = Delivery(self._variants, self._start, self._on_consumed)
            delivery = self._delivery
            state = delivery.ranks[rank]
            if state.writer is not None:
                raise Refused(f"rank {rank} is already connected")
            at = delivery.consumed(rank) if brought is None else brought["step"]
            # a promoted standby starts at the folder's position; each rank goes on from its own
            taken_over = self._standby and brought is not None and at >= delivery.slowest
            if not taken_over and at != delivery.consumed(rank) and (at not in delivery.positions
                                                                     or at < delivery.slowest):
                message = (f"rank {rank} brings the loader position of step {at}, but this job is at step "
                           f"{delivery.consumed(rank)}: restore the same checkpoint step on every rank")
                if self._planner.task is None:
                    self.fail(f"rank {rank}'s HELLO", ConfigError(message))
                raise Refused(message)
            if taken_over:
                try:
                    self._check_brought(at, brought)
                except OmniloadError as exc:
                    self.fail(f"rank {rank}'s HELLO", exc)
                    raise Refused(str(exc)) from None
            state = delivery.attach(rank, writer, hello.credits, at)
            writer.write(encode(Message(Kind.WELCOME, self._welcome(state, at, brought))))
            if taken_over and self._planner.task is not None:  # attach may have moved the slowest rank
                self._planner.allow(delivery.slowest + self.spec.plan_ahead)
            delivery.pump(state)
            if self._planner.task is None:
                self._stepper.dp = self._layout.dp
                planning = self._planner.start(allowed=delivery.slowest + self.spec.plan_ahead)
                planning.add_done_callback(lambda task: self._task_ended(task, "the planner"))
            return state

    def _check_hello(self, hello: Hello) -> dict | None:
        """Learn the world from the first rank; check the others agree. The position it brings."""
        if self._layout is None:
            self._layout = Layout(world=hello.world_size, tp=self.spec.tp, pp=self.spec.pp, cp=self.spec.cp,
                                  order=self.spec.rank_order)
            connecting = [r for r in range(hello.world_size) if self._layout.connects(r, self.spec.broadcast_at)]
            self._variants = {r: self._variant(r) for r in connecting}
            self._frame_kinds = sorted(set(self._variants.values()))
        elif hello.world_size != self._layout.world:
            raise ConfigError(f"rank {hello.rank} says the world has {hello.world_size} ranks; earlier ranks "
                              f"said {self._layout.world}")
        if hello.resume is None:
            return None
        brought = check_state(hello.resume, f"rank {hello.rank}'s loader state")
        self._check_same_data(brought, f"loader state rank {hello.rank} brought")
        return brought

    async def _reposition(self, position: dict) -> None:
        """Move the job to the loader position the first rank brought, before any step is planned."""
        await self._supervisor.restart_all(lambda: self._stepper.restore(position))
        self._planner.reapply_early_changes()
        self._start = position
        log.warning("resuming at step %d, the loader position the ranks brought", position["step"])

    def _welcome(self, state: RankState, at: int, brought: dict | None = None) -> dict:
        """pid, host, role ("primary", or "promoted" for a standby that took over) and epoch name
        the serving coordinator (for logs, tests, and the rank's refusal of an older epoch)."""
        return {"job": self.job_id, "fingerprint": self._fingerprint, "dp": self._layout.dp,
                "dp_rank": state.variant[0], "seq_len": self.spec.seq_len, "rows": self.spec.rows,
                "resume_step": at, "sources": self._source_names, "broadcast_at": self.spec.broadcast_at,
                "state": self._delivery.positions.get(at, brought),
                "pid": os.getpid(), "host": socket.gethostname(), "epoch": self._epoch,
                "role": "promoted" if self._standby else "primary",
                "layout": {"world": self._layout.world, "tp": self.spec.tp, "pp": self.spec.pp,
                           "cp": self.spec.cp, "order": self.spec.rank_order}}

    def acknowledge(self, state: RankState, step: int) -> None:
        delivery = self._delivery
        before = delivery.slowest
        delivery.acknowledge(state, step)
        if delivery.slowest != before:
            self._planner.allow(delivery.slowest + self.spec.plan_ahead)
            if self._arena is not None:  # every rank has read these steps' bytes
                self._arena.release_through(delivery.slowest - 1)

    def rank_gone(self, state: RankState) -> None:
        self._delivery.detach(state)
        if self._should_exit.is_set() or state.ended:
            pass
        elif state.said_bye:
            log.info("rank %d closed its loader after consuming %d steps", state.rank,
                     self._delivery.consumed(state.rank))
        else:
            log.warning("rank %d disconnected without saying goodbye after consuming %d steps; the job waits for "
                        "it to reconnect (--rank-timeout %gs)", state.rank, self._delivery.consumed(state.rank),
                        self.spec.rank_timeout)
        if self._delivery.finished():
            log.info("every rank has its data; exiting")
            self._should_exit.set()

    def status(self) -> dict[str, Any]:
        """The job's figures now (`omniload status`, the metrics endpoint, launch's progress)."""
        return self._figures.snapshot(self._delivery, self._stall_message)

    async def change_weights(self, weights: Any) -> int:
        """`omniload mix`: the step the new weights take effect at, exactly (the planner applies
        them between two steps)."""
        checked = self._check_weights(weights)
        step = await self._planner.change_weights(checked)
        log.info("mixture changed from step %d on: %s", step, checked)
        return step

    def _check_weights(self, weights: object) -> dict[str, float]:
        if not isinstance(weights, dict) or not weights:
            raise ConfigError("give weights as NAME=WEIGHT for one or more sources")
        unknown = sorted(set(weights) - set(self._source_names))
        if unknown:
            raise ConfigError(f"unknown source(s) {', '.join(unknown)}; sources: {', '.join(self._source_names)}")
        if any(not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0 for w in weights.values()) \
                or sum(weights.values()) <= 0:
            raise ConfigError(f"weights must be numbers >= 0, not all zero, got {weights}")
        return {k: float(v) for k, v in weights.items()}

    # -- planning ---------------------------------------------------------------------------
    def _encode_step(self, step: Step, position: dict) -> Frames:
        """One frame for each kind of rank (pure: it may run on a thread); each carries the
        loader position after the step, which the rank's state_dict() returns."""
        shared = step_fields({"dp": self._layout.dp, "imbalance": round(step.figures["imbalance"], 4),
                              "weights": dict(zip(self._source_names, step.weights)), "state": position})
        frames, full_rows = {}, {}
        for variant in self._frame_kinds:
            dp_rank, cp_rank, has_data = variant
            fields = {"tokens": step.tokens[dp_rank], "compact": has_data and self.spec.cp == 1}
            if not has_data:
                arrays = {}
            elif self.spec.cp == 1:
                arrays = step.batches[dp_rank]
            else:  # a slice's labels and positions need the whole row: sent, as int32
                if dp_rank not in full_rows:
                    full_rows[dp_rank] = expand(step.batches[dp_rank])
                arrays = narrow(cp_slice(full_rows[dp_rank], self.spec.cp, cp_rank))
            frames[variant] = self._place(step.number, *encode_batch(step.number, arrays, fields, shared))
        return frames

    def _on_step(self, number: int, frames: Frames, position: dict, tokens: int) -> None:
        expected = self._brought.pop(number + 1, None) if self._brought else None
        if expected is not None and expected != position:
            self.fail("the takeover", OmniloadError(
                f"a rank brought a loader position for step {number + 1} that differs from the one this coordinator "
                f"planned from {self.spec.checkpoint_dir}: the ranks and the checkpoint folder are not of the same run"))
            return
        if self._arena is not None and not self._arena_sized:
            self._reserve_arena(frames)
        self._delivery.add_step(number, frames, position, tokens)

    def _place(self, number: int, head: bytes, payload: bytes) -> Frame:
        """A frame, its payload copied into the step arena where senders serve and it has room
        (thread-safe: encoding may run on the planner's thread)."""
        arena = self._arena
        placed = arena.put(number, payload) if arena is not None else None
        return (head, *placed) if placed else (head, payload, None)

    def _reserve_arena(self, frames: Frames) -> None:
        """Allocate the step arena on a thread, sized by the first step; the steps before it is
        ready go over the senders' sockets."""
        arena, self._arena_sized = self._arena, True
        need = max(_ARENA_MIN, sum(len(payload) for _, payload, _ in frames.values()) * (self.spec.plan_ahead + 4) * 2)

        def reserved(done: asyncio.Future) -> None:
            if done.exception() is not None:
                log.warning("senders get batches over their sockets: no room for a %d MB step arena in /dev/shm (%s)",
                            need >> 20, done.exception())
                self._arena = None
                arena.close()

        self._loop.run_in_executor(None, arena.reserve, need).add_done_callback(reserved)

    def _spawn_senders(self) -> Senders | None:
        count = self.spec.senders if self.spec.senders >= 0 else available_cpus() // 8 if _CAN_SEND else 0
        if not count:
            return None
        if not _CAN_SEND:
            raise ConfigError("--senders needs Linux (pidfd_open and SCM_RIGHTS); use --senders 0 here")
        self._arena = StepArena(segment_path(os.getpid(), self.job_id, "arena"), _ARENA_CAPACITY)
        senders = Senders(count, self._arena.path, self.fail)
        senders.spawn()
        log.info("%d senders write batches to the ranks", count)
        return senders

    def _on_end(self, steps: int) -> None:
        log.info("data ended after %d steps", steps)
        self._delivery.end(steps)

    def _variant(self, rank: int) -> Variant:
        coords = self._layout.coords(rank)
        return coords["dp"], coords["cp"], self._layout.needs_data(rank, self.spec.pp_data)

    # -- the watch ---------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        started = due = time.monotonic()
        warned = False
        busy = time.thread_time()
        while True:
            due += _TICK_S
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now, was_busy, busy = time.monotonic(), busy, time.thread_time()
            if now - due > _LAG_WARN_S:
                _say_late(now - due, busy - was_busy)
            due = max(due, now - _TICK_S)
            if self._parent is not None and os.getppid() != self._parent:
                log.error("the launching process is gone; shutting down")
                self._exit_code = 1
                self._should_exit.set()
            if self._delivery and not warned and now - started > _CONNECT_WARN_S:
                missing = sorted(r for r, s in self._delivery.ranks.items() if not s.seen)
                if missing:
                    log.warning("still waiting for rank(s) %s to connect", missing)
                    warned = True
            self._figures.sample(self._delivery, now)
            if self._delivery:
                self._watch_ranks(now)

    def _watch_ranks(self, now: float) -> None:
        """Tell the waiting ranks which rank they wait for; past --rank-timeout, stop the job."""
        stall = self._delivery.stall(self.spec.plan_ahead, now)
        timeout = self.spec.rank_timeout
        self._stall_message = message = stall and stall.describe(self.spec.plan_ahead, timeout)
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
                writer = self._delivery.ranks[rank].writer
                if writer is not None:
                    writer.write(note)


def _say_late(late: float, cpu: float) -> None:
    """The tick came `late` seconds late, the loop's thread having used `cpu` seconds since the
    last one: its own work blocked it (a bug), or the host gave it no CPU (too busy a host)."""
    if cpu > late / 2:
        log.warning("the event loop was blocked for %.1fs by its own work; ranks waited meanwhile (a bug in "
                    "omniload: please report it)", late)
    else:
        log.warning("the coordinator got no CPU for %.1fs (it ran %.2fs of it): the host is overloaded; ranks "
                    "waited meanwhile. Leave the coordinator a core (fewer --workers, or fewer ranks per host)",
                    late, cpu)


async def _listen(serve: Callable, host: str, port: int, flag: str) -> asyncio.Server:
    return await asyncio.start_server(serve, sock=_bind(host, port, flag))


def _bind(host: str, port: int, flag: str) -> socket.socket:
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=4096)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another {flag} "
                          "(0 picks a free port)") from None


def _free_port(host: str) -> int:
    """A port free now, for a standby to announce before it listens (it binds it at takeover)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _reachable(host: str) -> str:
    return socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "::") else host


def _address_of(server: asyncio.Server) -> str:
    host, port = server.sockets[0].getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"
