"""The worker pool: rings, forked worker processes, and restarting a worker at the cursor.

Workers come from a forkserver started before the event loop, so no fork ever happens from
the running loop and a replacement starts as clean as the first worker.
Lifecycle of a worker: STARTED -> (EXITED 0: done | EXITED != 0: restarted or job fails).
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
from collections.abc import Callable

from omniload.order import first_of_lane
from omniload.spec import Spec
from omniload.workers.ring import Ring, segment_path
from omniload.workers.worker import LaneConfig, WorkerConfig, run_worker

from omniload.coordinator.catalog import SourceCatalog

log = logging.getLogger("omniload")
_WORKER_JOIN_S = 5.0


class WorkerProcess:
    """One worker process with the supervision verbs."""

    def __init__(self, ctx: multiprocessing.context.BaseContext, config: WorkerConfig) -> None:
        self.config = config
        self._process = ctx.Process(target=run_worker, args=(config,), name=f"omniload-worker-{config.worker_id}",
                                    daemon=True)

    def start(self) -> None:
        self._process.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def sentinel(self) -> int:
        return self._process.sentinel

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def terminate(self) -> None:
        if self._process.is_alive():
            self._process.terminate()

    def kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()

    def join(self, timeout: float) -> None:
        self._process.join(timeout)

    def describe_exit(self) -> str:
        code = self.exitcode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


class WorkerPool:
    """Owns every ring (creates and unlinks them) and every worker process."""

    def __init__(self, spec: Spec, catalog: list[SourceCatalog], plan: list[list[tuple[int, int]]],
                 job_id: str, coordinator_pid: int) -> None:
        self._spec = spec
        self._catalog = catalog
        self._plan = plan
        self._coordinator_pid = coordinator_pid
        self.lane_counts = [sum(1 for w in plan for s, _ in w if s == src.index) for src in catalog]
        capacity = spec.ring_mb << 20
        self.rings: dict[tuple[int, int], Ring] = {}
        for worker in plan:
            for source, lane in worker:
                path = segment_path(coordinator_pid, job_id, f"s{source}-l{lane}")
                self.rings[(source, lane)] = Ring.create(path, capacity)
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["omniload.workers.worker"])
        self.workers: list[WorkerProcess | None] = [None] * len(plan)
        self.restarts = [0] * len(plan)

    def source_rings(self, source: int) -> list[Ring]:
        return [self.rings[(source, lane)] for lane in range(self.lane_counts[source])]

    def start(self, worker_id: int, cursor_of: Callable[[int], tuple[int, int]]) -> WorkerProcess:
        """Start (or restart) a worker at the cursors of its sources; its rings must be empty."""
        lanes = []
        for source, lane in self._plan[worker_id]:
            src = self._catalog[source]
            k, pos = cursor_of(source)
            num_lanes = self.lane_counts[source]
            start_group = first_of_lane(lane, num_lanes, k)
            lanes.append(LaneConfig(
                source_index=source, source_name=src.name, column=src.column, tokenizer=src.tokenizer,
                lane=lane, num_lanes=num_lanes, ring_path=str(self.rings[(source, lane)].path),
                shards=src.shards, seed=self._spec.seed, epochs=src.epochs, interleave=self._spec.shard_interleave,
                start_group=start_group, start_pos=pos if start_group == k else 0,
                skip_bad_files=self._spec.on_bad_file == "skip"))
        process = WorkerProcess(self._ctx, WorkerConfig(worker_id=worker_id, coordinator_pid=self._coordinator_pid,
                                                         lanes=tuple(lanes)))
        process.start()
        self.workers[worker_id] = process
        return process

    def reset_rings(self, worker_id: int) -> None:
        for key in self._plan[worker_id]:
            self.rings[key].reset()

    def sources_of(self, worker_id: int) -> list[str]:
        return sorted({self._catalog[s].name for s, _ in self._plan[worker_id]})

    def source_indexes_of(self, worker_id: int) -> list[int]:
        return sorted({s for s, _ in self._plan[worker_id]})

    def stop(self) -> None:
        """Terminate and join every worker (kill what does not exit in time), unlink every ring."""
        self.stop_workers()
        for ring in self.rings.values():
            ring.close()
            ring.unlink()

    def stop_workers(self) -> None:
        alive = [w for w in self.workers if w is not None]
        for worker in alive:
            worker.terminate()
        for worker in alive:
            worker.join(_WORKER_JOIN_S)
            if worker.is_alive():
                log.warning("worker %s did not exit in %.0fs; killing it", worker.pid, _WORKER_JOIN_S)
                worker.kill()
                worker.join(_WORKER_JOIN_S)
