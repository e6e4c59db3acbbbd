"""Worker supervision on the event loop: notice an exit at once, replace the worker off the loop.

The loop watches every worker's sentinel. A worker that exits 0 has finished its lanes; one
that dies is replaced at its sources' cursors, its unread records dropped, up to
`--max-restarts` times, then the job fails naming the source and the exit. The rings are
reset and the cursors read on the loop, which is also where the planner reads the rings, so
the two never meet; only joining and forking happen on an executor thread.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from omniload.errors import SourceFailed

from omniload.coordinator.intake import SourceIntake
from omniload.coordinator.pool import WorkerPool

log = logging.getLogger("omniload")
_JOIN_DEAD_S = 1.0  # a worker whose sentinel fired has exited: its join only reaps it


class Supervisor:
    def __init__(self, pool: WorkerPool, intakes: list[SourceIntake], max_restarts: int,
                 fail: Callable[[str, BaseException], None]) -> None:
        self._pool, self._intakes, self._max_restarts = pool, intakes, max_restarts
        self._fail = fail
        self._tasks: set[asyncio.Task] = set()

    def watch_all(self) -> None:
        for worker_id in range(len(self._pool.workers)):
            self._watch(worker_id)

    def unwatch_all(self) -> None:
        loop = asyncio.get_running_loop()
        for worker in self._pool.workers:
            if worker is not None:
                loop.remove_reader(worker.sentinel)

    async def restart_all(self, before_start: Callable[[], None]) -> None:
        """Stop every worker, run `before_start` (e.g. move the cursors), start them all again."""
        self.unwatch_all()
        if self._tasks:  # a replacement under way finishes first, or two workers would share its rings
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self.unwatch_all()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._pool.stop_workers)
        before_start()
        for worker_id in range(len(self._pool.workers)):
            await self._start(worker_id)

    def _watch(self, worker_id: int) -> None:
        worker = self._pool.workers[worker_id]
        asyncio.get_running_loop().add_reader(worker.sentinel, self._on_exit, worker_id)

    def _on_exit(self, worker_id: int) -> None:
        asyncio.get_running_loop().remove_reader(self._pool.workers[worker_id].sentinel)
        task = asyncio.get_running_loop().create_task(self._replace(worker_id))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._fail("worker supervision", task.exception())

    async def _replace(self, worker_id: int) -> None:
        loop = asyncio.get_running_loop()
        worker = self._pool.workers[worker_id]
        await loop.run_in_executor(None, worker.join, _JOIN_DEAD_S)
        if worker.exitcode == 0 or self._pool.workers[worker_id] is not worker:
            return  # its lanes are done, or it was replaced meanwhile (restart_all)
        sources = ", ".join(f"'{s}'" for s in self._pool.sources_of(worker_id))
        cause = f"worker {worker.pid} for source {sources} {worker.describe_exit()}"
        if self._pool.restarts[worker_id] >= self._max_restarts:
            raise SourceFailed(sources.strip("'"), f"{cause}; gave up after {self._max_restarts} restarts "
                               "(--max-restarts)")
        self._pool.restarts[worker_id] += 1
        log.warning("%s; restarting it at the source cursor (restart %d of %d)", cause,
                    self._pool.restarts[worker_id], self._max_restarts)
        await self._start(worker_id)

    async def _start(self, worker_id: int) -> None:
        """A fresh worker at its sources' cursors; the dead one's unread records are dropped.
        Its rings stay empty until it starts, so the cursors cannot move meanwhile."""
        self._pool.reset_rings(worker_id)
        cursors = {source: self._intakes[source].cursor for source in self._pool.source_indexes_of(worker_id)}
        await asyncio.get_running_loop().run_in_executor(None, self._pool.start, worker_id, cursors.__getitem__)
        self._watch(worker_id)

    async def close(self) -> None:
        """Stop watching; wait for a replacement under way (it is quick) so none starts after."""
        self.unwatch_all()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
