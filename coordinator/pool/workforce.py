"""A job's source workers as one part: the pool, the intakes that read its rings, and the
supervisor that replaces the dead ones (pool/supervision.py).

CREATED (the pool and its rings) -> STARTED (`start`: every worker forked, before the event
loop) -> SUPERVISED (`supervise`, on the loop) -> CLOSED (`close`: no replacement starts after)
-> STOPPED (`stop`: workers joined, rings unlinked; always, from the coordinator's `finally`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from omniload.coordinator.pool.catalog import SourceCatalog
from omniload.coordinator.pool.intake import SourceIntake
from omniload.coordinator.pool.supervision import Supervisor
from omniload.coordinator.pool.worker_pool import WorkerPool
from omniload.spec import Spec


class Workforce:
    def __init__(self, spec: Spec, catalog: list[SourceCatalog], plan: list, job_id: str) -> None:
        """`plan`: the workers' lanes (pool/autoscale.py's initial_plan)."""
        self._spec, self._catalog, self._plan = spec, catalog, plan
        self.pool = WorkerPool(spec, catalog, plan, job_id, os.getpid())
        self.intakes: list[SourceIntake] = []
        self._supervisor: Supervisor | None = None

    def read_rings(self) -> list[SourceIntake]:
        """One intake per source over its rings: what the planner draws records from."""
        self.intakes = [
            SourceIntake(
                src,
                self.pool.source_rings(src.index),
                self._spec.seed,
                self._spec.shard_interleave,
                self.pool.ring_lock,
                self._corrupt,
            )
            for src in self._catalog
        ]
        return self.intakes

    def _corrupt(self, source: int, lane: int, why: str) -> None:
        """A lane's ring failed its checks: replace the worker serving it (see Supervisor.replace_lane)."""
        if self._supervisor is not None:
            self._supervisor.replace_lane(source, lane, why)

    def start(self) -> None:
        """Fork every worker that has lanes at its sources' cursors (with --workers auto the
        others are slots the pool may grow to). Before the event loop starts."""
        for worker_id, lanes in enumerate(self._plan):
            if lanes:
                self.pool.start(worker_id, lambda source, _lane: self.intakes[source].cursor)

    def supervise(self, fail: Callable[[str, BaseException], None]) -> None:
        """On the loop: replace the workers that die (and autoscale, with --workers auto)."""
        self._supervisor = Supervisor(self.pool, self.intakes, self._spec.max_restarts, fail)
        self._supervisor.watch_all()

    async def restart_all(self, before_start: Callable[[], None]) -> None:
        """Stop every worker, run `before_start` (e.g. move the cursors), start them all again."""
        assert self._supervisor is not None
        await self._supervisor.restart_all(before_start)

    async def close(self) -> None:
        if self._supervisor is not None:
            await self._supervisor.close()

    def stop(self) -> None:
        self.pool.stop()
