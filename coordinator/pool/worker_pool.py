"""The worker pool: rings, forked worker processes, and restarting a worker at the cursor.

Workers come from a forkserver started before the event loop, so no fork ever happens from
the running loop and a replacement starts as clean as the first worker.
Lifecycle of a worker: STARTED -> (EXITED 0: done | EXITED != 0: restarted or job fails |
STOPPED by a re-split only when it would not let a lane go).

The lanes (one ring each) are fixed for the job; the plan, which worker produces which
lanes, may change (`set_plan`, for the autoscaler: running workers let lanes go and take
others on through their inboxes, `WorkerProcess.take_on`), and never changes the data.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import threading
from collections import Counter
from collections.abc import Callable

from omniload.coordinator.pool.catalog import SourceCatalog
from omniload.coordinator.pool.forkserver import forkserver_context, run
from omniload.errors import ConfigError, OmniloadError
from omniload.formats.lane_config import LaneConfig, WorkerConfig
from omniload.formats.ring import SHM_DIR, Ring, segment_path
from omniload.spec import Spec

log = logging.getLogger("omniload")
_WORKER_JOIN_S = 5.0
_HELPER_STOP_S = 5.0
# Read-ahead budgets in bytes of int32 ids; a source whose ids travel as uint16 gets the same
# tokens in half the bytes (ring_span's id_bytes).
RING_BUDGET_MB = 16  # the read-ahead of all a job's rings together, split over its lanes
MIN_SPAN_MB = 1  # a lane's read-ahead at least (what the throughput benchmark runs with)
TURNS_BUDGET_MB = 32  # the same for lanes that take turns (a source's several lanes), split likewise
MIN_TURNS_SPAN_KB = 512  # ... at least: a turn (omniload.order.TURN) of 1k-token documents


# A forkserver child's exit code is read once from its sentinel pipe. Two threads reading it
# at once (the restart of one dead worker runs Process.start(), which polls every child, while
# another dead worker is joined on a thread) leave one with EOF, and multiprocessing then
# reports exit code 255 instead of the signal. Every poll of a worker goes through this lock.
_REAP_LOCK = threading.Lock()


class WorkerProcess:
    """One worker process with the supervision verbs, and an inbox for lanes it takes on."""

    def __init__(self, ctx: multiprocessing.context.ForkServerContext, config: WorkerConfig) -> None:
        self.config = config
        self._inbox, self._outbox = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=run, args=(config, self._inbox), name=f"omniload-worker-{config.worker_id}", daemon=True
        )

    def start(self) -> None:
        with _REAP_LOCK:
            self._process.start()
        self._inbox.close()  # the worker's end

    def take_on(self, lanes: tuple[LaneConfig, ...]) -> bool:
        """Send the worker more lanes to serve; False if it is gone (restart it instead)."""
        try:
            self._outbox.send(lanes)
        except OSError:
            return False
        return True

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def sentinel(self) -> int:
        return self._process.sentinel

    @property
    def exitcode(self) -> int | None:
        with _REAP_LOCK:
            return self._process.exitcode

    def is_alive(self) -> bool:
        with _REAP_LOCK:
            return self._process.is_alive()

    def terminate(self) -> None:
        if self.is_alive():
            self._process.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._process.kill()

    def join(self, timeout: float) -> int | None:
        """Wait up to `timeout` for the worker to end; its exit code (None while it runs). Call
        off the event loop: the lock may be held across another worker's start."""
        multiprocessing.connection.wait([self._process.sentinel], timeout)  # unlocked: it may take `timeout`
        with _REAP_LOCK:
            self._process.join(0)
            code = self._process.exitcode
        if code is not None:
            self._outbox.close()
        return code


class WorkerPool:
    """Owns every ring (creates and unlinks them) and every worker process."""

    def __init__(
        self,
        spec: Spec,
        catalog: list[SourceCatalog],
        plan: list[list[tuple[int, int]]],
        job_id: str,
        coordinator_pid: int,
    ) -> None:
        self.spec = self._spec = spec
        self._catalog = catalog
        self._plan = plan
        self._coordinator_pid = coordinator_pid
        self.lane_counts = [sum(1 for w in plan for s, _ in w if s == src.index) for src in catalog]
        self.rings = _create_rings(spec, plan, job_id, coordinator_pid, [c.id_bytes for c in catalog])
        self.ring_lock = threading.Lock()  # the intakes read under it, resets take it (pool/intake.py)
        self._ctx = forkserver_context()
        self.workers: list[WorkerProcess | None] = [None] * len(plan)
        self.restarts = [0] * len(plan)
        self.scaling: dict = {}  # the autoscaler's figures, for status (coordinator/pool/supervision.py)

    @property
    def plan(self) -> list[list[tuple[int, int]]]:
        return self._plan

    def set_plan(self, plan: list[list[tuple[int, int]]]) -> None:
        """Serve the same lanes with another packing; the workers whose lanes change must be
        stopped before and started after (Supervisor.replan)."""
        if sorted(key for worker in plan for key in worker) != sorted(self.rings):
            raise ValueError("a new plan must serve exactly the job's lanes")  # a bug, not the user's
        if len(plan) != len(self._plan):
            raise ValueError(f"a new plan must keep the job's {len(self._plan)} workers, got {len(plan)}")
        self._plan = [list(worker) for worker in plan]

    def source_rings(self, source: int) -> list[Ring]:
        return [self.rings[(source, lane)] for lane in range(self.lane_counts[source])]

    def start(self, worker_id: int, start_of: Callable[[int, int], tuple[int, int]]) -> WorkerProcess:
        """Start (or restart) a worker; each of its lanes (source, lane) produces from position
        `start_of(source, lane)` on: the source's cursor when its ring is empty, right after the
        ring's newest record when the ring keeps its records (SourceIntake.resume_at)."""
        lanes = tuple(self.lane_config(source, lane, start_of(source, lane)) for source, lane in self._plan[worker_id])
        process = WorkerProcess(
            self._ctx, WorkerConfig(worker_id=worker_id, coordinator_pid=self._coordinator_pid, lanes=lanes)
        )
        process.start()
        self.workers[worker_id] = process
        return process

    def lane_config(self, source: int, lane: int, start: tuple[int, int]) -> LaneConfig:
        """What a worker needs to produce lane `lane` of `source` from position `start` on."""
        ring = str(self.rings[(source, lane)].path)
        return lane_config(self._spec, self._catalog[source], lane, self.lane_counts[source], ring, start)

    def started(self, worker_id: int) -> WorkerProcess:
        """Worker `worker_id`, which must have been started."""
        worker = self.workers[worker_id]
        if worker is None:
            raise RuntimeError(f"worker {worker_id} was never started")
        return worker

    def reset_rings(self, worker_id: int) -> None:
        with self.ring_lock:  # an intake may be reading them on a replay's thread
            for key in self._plan[worker_id]:
                self.rings[key].reset()

    def worker_of(self, source: int, lane: int) -> int | None:
        """The worker serving the lane in the current plan."""
        return next((w for w, lanes in enumerate(self._plan) if (source, lane) in lanes), None)

    def sources_of(self, worker_id: int) -> list[str]:
        return sorted({self._catalog[s].name for s, _ in self._plan[worker_id]})

    def source_indexes_of(self, worker_id: int) -> list[int]:
        return sorted({s for s, _ in self._plan[worker_id]})

    def workers_of_source(self, source: int) -> list[WorkerProcess]:
        return [w for i, w in enumerate(self.workers) if w is not None and source in self.source_indexes_of(i)]

    def restarts_of_source(self, source: int) -> int:
        return sum(n for i, n in enumerate(self.restarts) if source in self.source_indexes_of(i))

    def stop(self) -> None:
        """Terminate and join every worker (kill what does not exit in time), unlink every ring,
        and stop the forkserver and resource tracker: when the coordinator exits, no process of
        the job is left."""
        self.stop_workers()
        for ring in self.rings.values():
            ring.close()
            ring.unlink()
        stop_helpers()

    def stop_workers(self, worker_ids: list[int] | None = None) -> None:
        """Terminate and join these workers (all by default), killing what does not exit in time."""
        ids = range(len(self.workers)) if worker_ids is None else worker_ids
        alive = [worker for i in ids if (worker := self.workers[i]) is not None]
        for worker in alive:
            worker.terminate()
        for worker in alive:
            worker.join(_WORKER_JOIN_S)
            if worker.is_alive():
                log.warning("worker %s did not exit in %.0fs; killing it", worker.pid, _WORKER_JOIN_S)
                worker.kill()
                worker.join(_WORKER_JOIN_S)
            if worker.is_alive():  # its rings must never get a second producer
                raise OmniloadError(
                    f"worker {worker.pid} did not exit {2 * _WORKER_JOIN_S:.0f}s after SIGTERM and SIGKILL "
                    "(stuck in the kernel: a hung disk or network filesystem?); its rings cannot go to another"
                )


def describe_exit(code: int | None) -> str:
    """How a child process ended, from its exit code (negative: the signal that killed it)."""
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, e.g. a container's cpuset), else the count;
    OMNILOAD_CPUS overrides both (to size `--workers auto` for another machine, or to measure it)."""
    override = os.environ.get("OMNILOAD_CPUS")
    if override:
        try:
            return max(1, int(override))
        except ValueError:
            raise ConfigError(f"OMNILOAD_CPUS must be a number of CPUs, got {override!r}") from None
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def ring_span(ring_mb: int, lanes: int, source_lanes: int = 1, id_bytes: int = 4) -> int:
    """Bytes of read-ahead one lane's ring holds (omniload/formats/ring.py). A source's only lane needs
    just enough to cover the planner's bursts: its share of the job's RING_BUDGET_MB, at least
    MIN_SPAN_MB, at most --ring-mb (which bounds one record); with many lanes the sum is what
    counts. A source with several lanes splits a larger budget, TURNS_BUDGET_MB: its lanes take
    turns (omniload.order), and a lane on a worker of its own produces its next turn only once
    its ring holds it, so the floor is about a turn, MIN_TURNS_SPAN_KB. A job of few lanes gives
    them --ring-mb in full; one of many (16 sources x 4 lanes on a 16-core budget) half a MB
    each, 32 MB in all (the rings are most of what such a job holds beyond one of 16 lanes).
    All of these count int32 ids: a source whose records hold uint16 ids (id_bytes 2) gets as
    many tokens of read-ahead in half the bytes."""
    if source_lanes > 1:
        budget, floor = TURNS_BUDGET_MB << 20, MIN_TURNS_SPAN_KB << 10
    else:
        budget, floor = RING_BUDGET_MB << 20, MIN_SPAN_MB << 20
    return min(ring_mb << 20, max(floor, budget // max(1, lanes)) * id_bytes // 4)


def _create_rings(
    spec: Spec, plan: list[list[tuple[int, int]]], job_id: str, coordinator_pid: int, id_bytes: list[int]
) -> dict[tuple[int, int], Ring]:
    """One ring per lane, for records up to --ring-mb, its span (ring_span) allocated; raises
    ConfigError (and leaves no ring) when the shared-memory directory cannot hold them all."""
    rings: dict[tuple[int, int], Ring] = {}
    keys = [key for worker in plan for key in worker]
    lanes_of = Counter(source for source, _ in keys)
    try:
        for source, lane in keys:
            path = segment_path(coordinator_pid, job_id, f"s{source}-l{lane}")
            span = ring_span(spec.ring_mb, len(keys), lanes_of[source], id_bytes[source])
            rings[(source, lane)] = Ring.create(path, spec.ring_mb << 20, span)
    except OSError as exc:
        for ring in rings.values():
            ring.close()
            ring.unlink()
        raise _shm_error(exc, spec, plan, id_bytes) from None
    return rings


def _shm_error(exc: OSError, spec: Spec, plan: list[list[tuple[int, int]]], id_bytes: list[int]) -> ConfigError:
    lanes = sum(len(worker) for worker in plan)
    if exc.errno != errno.ENOSPC:
        return ConfigError(f"cannot create a shared-memory ring in {SHM_DIR}: {exc}")
    usage = shutil.disk_usage(SHM_DIR)
    fewer = " / --workers" if lanes > len(spec.sources) else ""  # below one lane per source it cannot go
    lanes_of = Counter(source for worker in plan for source, _ in worker)
    need = sum(ring_span(spec.ring_mb, lanes, n, id_bytes[source]) * n for source, n in lanes_of.items())
    each = f"--ring-mb {spec.ring_mb}" if need == lanes * (spec.ring_mb << 20) else "their read-ahead"
    return ConfigError(
        f"{SHM_DIR} is too small for this job's rings: it holds {_mb(usage.total)} with {_mb(usage.free)} free, "
        f"the job needs {_mb(need)} ({lanes} lanes x {each}); "
        f"enlarge {SHM_DIR} (docker run --shm-size=...) or lower --ring-mb{fewer}"
    )


def _mb(size: int) -> str:
    return f"{size / (1 << 20):.1f} MB"


def lane_config(
    spec: Spec, src: SourceCatalog, lane: int, num_lanes: int, ring_path: str, start: tuple[int, int]
) -> LaneConfig:
    """What a worker needs to produce lane `lane` of `num_lanes` of source `src` into the ring at
    `ring_path`, from position `start` on."""
    return LaneConfig(
        source_index=src.index,
        source_name=src.name,
        column=src.column,
        tokenizer=src.tokenizer,
        lane=lane,
        num_lanes=num_lanes,
        ring_path=ring_path,
        shards=src.shards,
        seed=spec.seed,
        epochs=src.epochs,
        interleave=spec.shard_interleave,
        start_group=start[0],
        start_pos=start[1],
        skip_bad_files=spec.on_bad_file == "skip",
        image_column=src.image_column,
        images=src.images,
        store=src.store,
        read_ahead=spec.read_ahead,
        cache_dir=spec.cache_dir,
        cache_limit=spec.cache_limit,
        pretokenized=src.pretokenized,
        chat=src.chat,
    )


def stop_helpers() -> None:
    """Stop the forkserver, then the resource tracker, and reap them.

    Both exit by themselves only once every holder of their pipe has exited, the coordinator
    included, so without this they outlive the coordinator (by tens of ms, seconds on a busy
    machine). Python has no public call for it; `_stop()` is what its own tests use. Each waits
    for every worker's copy of the pipe to close, so a stray descendant holding one is killed
    after _HELPER_STOP_S rather than hanging the shutdown."""
    from multiprocessing import forkserver, resource_tracker

    for helper, pid_field in (
        (forkserver._forkserver, "_forkserver_pid"),
        (resource_tracker._resource_tracker, "_pid"),
    ):
        pid = getattr(helper, pid_field, None)
        if pid is None or not hasattr(helper, "_stop"):
            continue
        deadline = threading.Timer(_HELPER_STOP_S, _kill_late, args=(pid,))
        deadline.start()
        try:
            helper._stop()
        finally:
            deadline.cancel()


def _kill_late(pid: int) -> None:
    log.warning("multiprocessing helper %d did not exit in %.0fs; killing it", pid, _HELPER_STOP_S)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
