"""The coordinator: one asyncio process per job.

It reads top to bottom: index sources and fork the worker pool (before the loop) -> bind and
announce -> plan steps ahead of the slowest rank while serving ranks -> shut down (close
connections, stop workers, unlink rings). A second Ctrl-C forces the exit.

Rank sessions: STARTING (HELLO with the token within the handshake timeout) -> SERVING
(batches while the rank has credit; each ACK returns a credit and moves the rank's consumed
position) -> CLOSED. A reconnecting rank resumes after the last step it acknowledged.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from omniload.errors import ConfigError, OmniloadError, ProtocolError, SourceFailed
from omniload.layout import Layout
from omniload.protocol import FrameDecoder, Kind, Message, encode
from omniload.spec import Spec
from omniload.state import check_state
from omniload.workers.readers import use_system_allocator
from omniload.workers.ring import remove_stale_segments

from omniload.coordinator.batches import encode_batch
from omniload.coordinator.catalog import build_catalog, fingerprint, job_identity
from omniload.coordinator.checkpoint import CheckpointWriter, Recovery, explain_mismatch, last_position
from omniload.coordinator.intake import SourceIntake
from omniload.coordinator.lanes import assign_lanes
from omniload.coordinator.pool import WorkerPool, WorkerProcess
from omniload.coordinator.parallel import cp_slice
from omniload.coordinator.stepper import Step, Stepper

log = logging.getLogger("omniload")
_HANDSHAKE_S = 10.0
_TICK_S = 0.5
_RANK_WAIT_WARN_S = 60.0
_READ_CHUNK = 64 * 1024
CONTROL = object()  # what _accept returns for a control (not rank) connection


@dataclass(slots=True)
class RankState:
    rank: int
    variant: tuple[int, int, bool]  # (dp rank, cp rank, receives data): which frame of each step
    consumed: int = 0  # steps acknowledged
    sent: int = 0  # steps written to the socket
    credits: int = 0
    writer: asyncio.StreamWriter | None = None
    ended: bool = False
    said_bye: bool = False  # the rank closed on purpose (else it died or lost the network)


@dataclass(slots=True)
class _Steps:
    """Planned steps not yet consumed by every rank: step number -> one frame per rank variant."""

    frames: dict[int, dict[tuple[int, int, bool], tuple[bytes, bytes]]] = field(default_factory=dict)
    positions: dict[int, dict] = field(default_factory=dict)  # steps completed -> loader position then
    planned: int = 0
    final: int | None = None  # set when the data has ended: the number of steps there are


class Coordinator:
    def __init__(self, spec: Spec, token: str, host: str = "127.0.0.1", port: int = 0,
                 announce: Callable[[str], None] = print, job_id: str | None = None,
                 exit_with_parent: bool = False) -> None:
        self.spec = spec
        self._token = token.encode()
        self._host, self._port = host, port
        self._announce = announce
        self.job_id = job_id or os.urandom(4).hex()
        self._parent = os.getppid() if exit_with_parent else None
        self._source_names = [s.name for s in spec.sources]
        self._ranks: dict[int, RankState] = {}
        self._steps = _Steps()
        self._start_step = 0
        self._layout: Layout | None = None
        self._expected: set[int] = set()  # the ranks that connect (all, or tp rank 0 of each group)
        self._variants: list[tuple[int, int, bool]] = []
        self._live_changes: list[tuple[int, dict[str, float]]] = []
        self._stepper: Stepper | None = None
        self._checkpoints: CheckpointWriter | None = None
        self._recovery: Recovery | None = None  # a --resume folder's position, replayed at startup
        self._loop: asyncio.AbstractEventLoop | None = None
        self._note: str | None = None  # said once in the checkpoint log (e.g. allow_changed_data)
        self._planning = False
        self._exit_code = 0
        self._should_exit: asyncio.Event
        self._progress: asyncio.Event
        self._world_known: asyncio.Event

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to its end; returns the process exit code. Call with no loop running."""
        for path in remove_stale_segments():
            log.info("removed %s, left by a job that died", path.name)
        use_system_allocator()
        catalog = build_catalog(self.spec)
        budget = self.spec.workers or min(len(catalog), os.cpu_count() or 1)
        plan = assign_lanes(self.spec.weights(), budget)
        self._identity = job_identity(self.spec, catalog)
        self._fingerprint = fingerprint(self._identity)
        self._recovery = self._read_resume_folder()
        self._pool = WorkerPool(self.spec, catalog, plan, self.job_id, os.getpid())
        try:
            self._intakes = [SourceIntake(src, self._pool.source_rings(src.index), self.spec.seed,
                                         self.spec.shard_interleave) for src in catalog]
            self._stepper = Stepper(self.spec, self._intakes, self._live_changes)
            if self._recovery:  # the snapshot now, the steps after it replayed once the loop runs
                recovery = self._recovery
                self._stepper.restore({**recovery.state, "live": recovery.state["live"] + recovery.live})
            else:
                self._start_at(self._stepper.export_state(self._fingerprint))
            for worker_id in range(len(plan)):
                self._pool.start(worker_id, self._cursor_of)
            folder = self.spec.checkpoint_dir or self.spec.resume
            if folder:
                self._checkpoints = CheckpointWriter(folder, self.spec.snapshot_every, self.spec.keep_snapshots,
                                                     self._identity, self._checkpoint_failed)
            log.info("job %s: %d sources, %d workers, %d lanes", self.job_id, len(catalog), len(plan),
                     sum(self._pool.lane_counts))
            _run_loop(self._main())
        finally:
            self._pool.stop()
            if self._checkpoints:
                self._checkpoints.close()
        return self._exit_code

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

    async def _replay(self, recovery: Recovery) -> None:
        """Plan again the steps from the snapshot to the last consumed one, at the size that
        planned them: planning is a pure function of the position, so they come out the same."""
        started = time.monotonic()
        self._stepper.dp = recovery.dp
        await self._stepper.rehydrate()
        for _ in range(recovery.replay):
            await self._stepper.next_step(build=False)
        self._start_at(self._stepper.export_state(self._fingerprint))
        log.warning("resuming from %s at step %d, its last consistent step (snapshot of step %d, %d steps "
                    "replayed in %.2fs)", self.spec.resume, recovery.step, recovery.state["step"], recovery.replay,
                    time.monotonic() - started)

    def _checkpoint_failed(self, exc: BaseException) -> None:
        """From the checkpoint writer's thread: stop the job, naming the folder."""
        folder = self.spec.checkpoint_dir or self.spec.resume
        error = OmniloadError(f"checkpoint folder {folder}: {exc}; free space there or choose another --checkpoint-dir")
        if self._loop is None or self._loop.is_closed():  # no loop yet, or it has already ended
            log.error("%s", error)
            return
        self._loop.call_soon_threadsafe(self._fail, error)

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

    def _start_at(self, position: dict) -> None:
        self._start_step = position["step"]
        self._steps = _Steps(positions={position["step"]: position}, planned=position["step"])

    def _reposition(self, position: dict) -> None:
        """Move the job to a rank's loader position before the first step is planned."""
        loop = asyncio.get_running_loop()
        for worker in self._pool.workers:
            loop.remove_reader(worker.sentinel)
        self._pool.stop_workers()
        self._stepper.restore(position)
        self._start_at(position)
        for worker_id in range(len(self._pool.workers)):
            self._restart(worker_id)
        log.warning("resuming at step %d, the loader position the ranks brought", position["step"])

    def _record_consumed(self, before: int, after: int) -> None:
        """Checkpoint each step that every rank has now consumed."""
        if self._checkpoints is None:
            return
        for done in range(before + 1, after + 1):
            self._checkpoints.write(self._steps.positions[done], self._layout.dp, self._note)
            self._note = None

    async def _main(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._should_exit, self._progress, self._world_known = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._install_signal_handlers(loop)
        for worker_id, worker in enumerate(self._pool.workers):
            self._supervise(worker, worker_id)
        if self._recovery:
            try:
                await self._replay(self._recovery)
            except OmniloadError as exc:
                self._fail(exc)
                return
        server = await asyncio.start_server(self._serve_rank, self._host, self._port)
        host, port = server.sockets[0].getsockname()[:2]
        self._announce(f"{_public_host(host)}:{port}")
        planner = asyncio.create_task(self._plan_loop())
        ticker = asyncio.create_task(self._tick_loop())
        try:
            await self._should_exit.wait()
        finally:
            server.close()
            for task in (planner, ticker):
                task.cancel()
            for state in self._ranks.values():
                if state.writer is not None:
                    state.writer.close()
            for worker in self._pool.workers:
                loop.remove_reader(worker.sentinel)
            await asyncio.gather(planner, ticker, return_exceptions=True)

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
            self._should_exit.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)

    def _fail(self, exc: BaseException) -> None:
        """Stop the job: tell every rank why, exit 2 for bad config and 1 otherwise."""
        if self._should_exit.is_set():
            return
        log.error("%s", exc)
        self._exit_code = 2 if isinstance(exc, ConfigError) else 1
        frame = encode(Message(Kind.ERROR, {"message": str(exc)}))
        for state in self._ranks.values():
            if state.writer is not None:
                state.writer.write(frame)
        self._should_exit.set()

    # -- supervision ------------------------------------------------------------------------
    def _cursor_of(self, source: int) -> tuple[int, int]:
        return self._intakes[source].cursor

    def _on_worker_exit(self, worker_id: int) -> None:
        loop = asyncio.get_running_loop()
        worker = self._pool.workers[worker_id]
        loop.remove_reader(worker.sentinel)
        worker.join(1.0)
        if worker.exitcode == 0:
            return  # its lanes are done
        sources = ", ".join(f"'{s}'" for s in self._pool.sources_of(worker_id))
        cause = f"worker {worker.pid} for source {sources} {worker.describe_exit()}"
        if self._pool.restarts[worker_id] >= self.spec.max_restarts:
            self._fail(SourceFailed(sources.strip("'"), f"{cause}; gave up after {self.spec.max_restarts} "
                                    "restarts (--max-restarts)"))
            return
        self._pool.restarts[worker_id] += 1
        log.warning("%s; restarting it at the source cursor (restart %d of %d)", cause,
                    self._pool.restarts[worker_id], self.spec.max_restarts)
        self._restart(worker_id)

    def _restart(self, worker_id: int) -> None:
        """A fresh worker at its sources' cursors; the dead one's unread records are dropped."""
        self._pool.reset_rings(worker_id)
        self._supervise(self._pool.start(worker_id, self._cursor_of), worker_id)

    def _supervise(self, worker: WorkerProcess, worker_id: int) -> None:
        asyncio.get_running_loop().add_reader(worker.sentinel, self._on_worker_exit, worker_id)

    async def _tick_loop(self) -> None:
        started = time.monotonic()
        warned = False
        while True:
            await asyncio.sleep(_TICK_S)
            if self._parent is not None and os.getppid() != self._parent:
                log.error("the launching process is gone; shutting down")
                self._exit_code = 1
                self._should_exit.set()
            if self._layout and not warned and time.monotonic() - started > _RANK_WAIT_WARN_S:
                missing = sorted(self._expected - set(self._ranks))
                if missing:
                    log.warning("still waiting for rank(s) %s to connect", missing)
                    warned = True

    # -- planning ---------------------------------------------------------------------------
    async def _plan_loop(self) -> None:
        try:
            await self._world_known.wait()
            stepper = self._stepper
            stepper.dp = self._layout.dp
            self._planning = True
            while True:
                while self._steps.planned - self._slowest() >= self.spec.plan_ahead:
                    self._progress.clear()
                    await self._progress.wait()
                step = await stepper.next_step()
                if step is None:
                    self._steps.final = self._steps.planned
                    log.info("data ended after %d steps", self._steps.final)
                    self._pump_all()
                    return
                position = stepper.export_state(self._fingerprint)
                self._steps.positions[step.number + 1] = position
                self._steps.frames[step.number] = self._encode_step(step, position)
                self._steps.planned = step.number + 1
                self._pump_all()
        except asyncio.CancelledError:
            raise
        except OmniloadError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug must stop the job loudly, not hang the ranks
            log.exception("planner crashed")
            self._fail(OmniloadError(f"planner crashed: {type(exc).__name__}: {exc}"))

    def _encode_step(self, step: Step, position: dict) -> dict[tuple[int, int, bool], tuple[bytes, bytes]]:
        """One frame for each kind of rank that is connected or expected; each carries the
        loader position after the step, which the rank's state_dict() returns."""
        meta = {"tokens": step.tokens, "dp": self._layout.dp, "plan": step.figures,
                "weights": dict(zip(self._source_names, step.weights)), "state": position}
        frames = {}
        for variant in self._variants:
            dp_rank, cp_rank, has_data = variant
            arrays = cp_slice(step.batches[dp_rank], self.spec.cp, cp_rank) if has_data else {}
            frames[variant] = encode_batch(step.number, arrays, meta)
        return frames

    def _variant(self, rank: int) -> tuple[int, int, bool]:
        coords = self._layout.coords(rank)
        return coords["dp"], coords["cp"], self._layout.needs_data(rank, self.spec.pp_data)

    def _slowest(self) -> int:
        if self._layout is None or len(self._ranks) < len(self._expected):
            return self._start_step
        return min(state.consumed for state in self._ranks.values())

    def _pump_all(self) -> None:
        for state in self._ranks.values():
            self._pump(state)

    def _pump(self, state: RankState) -> None:
        """Send what the rank has credit for; END once it has every step."""
        writer = state.writer
        if writer is None or writer.is_closing():
            return
        while state.credits > 0 and state.sent < self._steps.planned:
            head, payload = self._steps.frames[state.sent][state.variant]
            writer.write(head)
            writer.write(payload)
            state.sent += 1
            state.credits -= 1
        if self._steps.final is not None and state.sent >= self._steps.final and not state.ended:
            writer.write(encode(Message(Kind.END, {"steps": self._steps.final})))
            state.ended = True

    def _forget_consumed(self, before: int) -> None:
        slowest = self._slowest()
        if slowest > before:
            self._record_consumed(before, slowest)
        for number in [n for n in self._steps.frames if n < slowest]:
            del self._steps.frames[number]
        for done in [n for n in self._steps.positions if n < slowest]:
            del self._steps.positions[done]

    # -- rank sessions ----------------------------------------------------------------------
    async def _serve_rank(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        _nodelay(writer)
        state = None
        try:
            inbox = _Inbox(reader)
            async with asyncio.timeout(_HANDSHAKE_S):
                hello = await inbox.next()
            state = self._accept(hello, writer)
            if state is CONTROL:
                state = None
                await self._serve_control(inbox, writer)
                return
            if state is None:
                return
            while (message := await inbox.next()) is not None:
                if message.kind is Kind.BYE:
                    state.said_bye = True
                    continue
                if message.kind is not Kind.ACK:
                    raise ProtocolError(f"unexpected {message.kind.name} from rank {state.rank}")
                before = self._slowest()
                state.consumed = max(state.consumed, int(message.header["step"]) + 1)
                state.credits += 1
                self._pump(state)
                self._forget_consumed(before)
                self._progress.set()
        except (ProtocolError, TimeoutError, KeyError, ValueError, TypeError) as exc:
            log.warning("dropped connection from %s: %s", peer, exc or type(exc).__name__)
            writer.write(encode(Message(Kind.ERROR, {"message": f"protocol error: {exc}"})))
        except (ConnectionError, asyncio.CancelledError):
            pass  # the peer is gone, or the coordinator is shutting down: end the session quietly
        finally:
            if state is not None:
                state.writer = None
                if not state.ended and not self._should_exit.is_set():
                    say = log.info if state.said_bye else log.warning
                    say("rank %d disconnected after consuming %d steps; it may reconnect", state.rank, state.consumed)
                self._maybe_finish()
            writer.close()

    def _accept(self, hello: Message | None, writer: asyncio.StreamWriter) -> RankState | None:
        """Check a HELLO; register the rank or answer ERROR and return None."""
        if hello is None:
            return None
        if hello.kind is not Kind.HELLO:
            raise ProtocolError(f"expected HELLO, got {hello.kind.name}")
        if not hmac.compare_digest(str(hello.header.get("token", "")).encode(), self._token):
            return self._refuse(writer, "authentication failed: wrong OMNILOAD_TOKEN")
        if hello.header.get("role") == "control":
            return CONTROL
        rank, world = int(hello.header["rank"]), int(hello.header["world_size"])
        try:
            if self._layout is None:
                self._layout = Layout(world=world, tp=self.spec.tp, pp=self.spec.pp, cp=self.spec.cp,
                                      order=self.spec.rank_order)
                self._expected = {r for r in range(world) if self._layout.connects(r, self.spec.broadcast_at)}
                self._variants = sorted({self._variant(r) for r in self._expected})  # one frame each per step
                self._world_known.set()
            elif world != self._layout.world:
                raise ConfigError(f"rank {rank} says the world has {world} ranks; earlier ranks said "
                                  f"{self._layout.world}")
            variant = self._variant(rank)
            brought = hello.header.get("resume")
            if brought is not None:
                brought = check_state(brought, f"rank {rank}'s loader state")
                self._check_same_data(brought, f"loader state rank {rank} brought")
        except ConfigError as exc:
            self._refuse(writer, str(exc))
            self._fail(exc)
            return None
        if rank not in self._expected:
            return self._refuse(writer, f"rank {rank} should not connect: with broadcast_at=tp only tp rank 0 "
                                        "of each group connects (use omniload.connect(broadcast_at='tp') on every rank)")
        state = self._ranks.get(rank)
        if state is not None and state.writer is not None:
            return self._refuse(writer, f"rank {rank} is already connected")
        if brought is not None and not self._planning and brought["step"] != self._start_step and not self._ranks:
            self._reposition(brought)
        if state is None:
            state = self._ranks[rank] = RankState(rank, variant, consumed=self._start_step)
        if brought is not None and brought["step"] != state.consumed:
            if brought["step"] not in self._steps.positions or brought["step"] < self._slowest():
                message = (f"rank {rank} brings the loader position of step {brought['step']}, but this job "
                           f"is at step {state.consumed}: restore the same checkpoint step on every rank")
                self._refuse(writer, message)
                if not self._planning:
                    self._fail(ConfigError(message))
                return None
            state.consumed = brought["step"]
        state.writer, state.sent, state.ended, state.said_bye = writer, state.consumed, False, False
        state.credits = max(1, int(hello.header.get("credits", 1)))
        writer.write(encode(Message(Kind.WELCOME, {
            "job": self.job_id, "fingerprint": self._fingerprint, "dp": self._layout.dp, "dp_rank": variant[0],
            "seq_len": self.spec.seq_len, "rows": self.spec.rows, "resume_step": state.consumed,
            "sources": self._source_names, "broadcast_at": self.spec.broadcast_at,
            "state": self._steps.positions[state.consumed],
            "layout": {"world": self._layout.world, "tp": self.spec.tp, "pp": self.spec.pp, "cp": self.spec.cp,
                       "order": self.spec.rank_order}})))
        self._pump(state)
        return state

    async def _serve_control(self, inbox: _Inbox, writer: asyncio.StreamWriter) -> None:
        """`omniload mix`: each MIX sets the weights from the next step to be planned on."""
        while (message := await inbox.next()) is not None:
            if message.kind is not Kind.MIX:
                raise ProtocolError(f"unexpected {message.kind.name} on a control connection")
            try:
                weights = self._check_weights(message.header.get("weights"))
            except ConfigError as exc:
                writer.write(encode(Message(Kind.ERROR, {"message": str(exc)})))
                continue
            at = self._stepper.step
            self._live_changes.append((at, weights))
            log.info("mixture changed from step %d on: %s", at, weights)
            writer.write(encode(Message(Kind.MIX, {"step": at, "weights": weights})))

    def _check_weights(self, weights: object) -> dict[str, float]:
        if not isinstance(weights, dict) or not weights:
            raise ConfigError("give weights as NAME=WEIGHT for one or more sources")
        unknown = sorted(set(weights) - set(self._source_names))
        if unknown:
            raise ConfigError(f"unknown source(s) {', '.join(unknown)}; sources: {', '.join(self._source_names)}")
        if any(not isinstance(w, (int, float)) or w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ConfigError(f"weights must be numbers >= 0, not all zero, got {weights}")
        # a change names the sources it sets; the others keep the weight they have now
        current = dict(zip(self._source_names, self._stepper.upcoming_weights()))
        return {**current, **{k: float(v) for k, v in weights.items()}}

    def _refuse(self, writer: asyncio.StreamWriter, message: str) -> None:
        log.warning("refused a rank: %s", message)
        writer.write(encode(Message(Kind.ERROR, {"message": message})))

    def _maybe_finish(self) -> None:
        """The job is done when every rank has been sent END and has hung up."""
        if self._layout and len(self._ranks) == len(self._expected) and all(
                s.ended and s.writer is None for s in self._ranks.values()):
            log.info("every rank has its data; exiting")
            self._should_exit.set()


class _Inbox:
    """Control messages from one rank's stream, decoded by the sans-I/O FrameDecoder."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._decoder = FrameDecoder()
        self._queued: deque[Message] = deque()

    async def next(self) -> Message | None:
        """The next message, or None at end of stream."""
        while not self._queued:
            data = await self._reader.read(_READ_CHUNK)
            if not data:
                if self._decoder.pending:
                    raise ProtocolError(f"connection closed inside a frame ({self._decoder.pending} bytes pending)")
                return None
            self._queued.extend(self._decoder.feed(data))
        return self._queued.popleft()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _public_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return host


def _run_loop(main) -> None:
    try:
        import uvloop
    except ImportError:  # uvloop is not on every platform; asyncio's loop works the same, slower
        asyncio.run(main)
        return
    uvloop.run(main)
