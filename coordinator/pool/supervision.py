"""Worker supervision on the event loop: notice an exit at once, replace the worker off the loop.

The loop watches every worker's sentinel. A worker that exits 0 has finished its lanes; one
that dies is replaced at its sources' cursors, its unread records dropped, up to
`--max-restarts` times, then the job fails naming the source and the exit. The rings are
reset and the cursors read on the loop, which is also where the planner reads the rings, so
the two never meet; only joining and forking happen on an executor thread.

With `--workers auto` the supervisor also runs the autoscaler: every `--autoscale-every`
seconds it reads each source's counters (its lanes' CPU time and tokens written, the tokens
the planner took, how often the planner found its rings empty), and when sources starve with
every running worker busy it doubles the workers (up to the budget), when none starves and the
workers are mostly idle it halves them (the freed ones stop), else when a packing of
the lanes by measured cost promises enough more throughput (coordinator/pool/autoscale.py) it
hands the lanes that change workers over (a new worker starts with its lanes): the old worker
lets each go (ring handover), the new one takes it on (its inbox) and goes on after the ring's
newest record, and the planner reads on from the ring meanwhile. No worker restarts. The
lanes' turns fix every position's producer, so the data cannot tell.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from omniload.coordinator.pool.autoscale import (
    MARGIN,
    Window,
    demands,
    grow,
    idle,
    moves,
    resplit,
    running,
    saturated,
    shrink,
    update_costs,
    update_taken,
    workers_per_source,
)
from omniload.coordinator.pool.intake import SourceIntake
from omniload.coordinator.pool.worker_pool import WorkerPool, describe_exit
from omniload.errors import SourceFailed

log = logging.getLogger("omniload")
_JOIN_DEAD_S = 1.0  # a worker whose sentinel fired has exited: its join only reaps it
_RELEASE_S = 5.0  # a worker lets a lane go between two bursts of records
_RELEASE_POLL_S = 0.005
_STARVED_POLLS = 20  # empty polls in a window (about 0.2 s of the planner waiting) that make a source starved


class Supervisor:
    def __init__(
        self,
        pool: WorkerPool,
        intakes: list[SourceIntake],
        max_restarts: int,
        fail: Callable[[str, BaseException], None],
    ) -> None:
        self._pool, self._intakes, self._max_restarts = pool, intakes, max_restarts
        self._fail = fail
        self._tasks: set[asyncio.Task] = set()
        self._moving = asyncio.Lock()  # a re-split and a restart of all never interleave
        self._why: dict[int, str] = {}  # worker -> why it was stopped to be replaced (replace_lane)
        self._scaler: asyncio.Task | None = None

    def watch_all(self) -> None:
        for worker_id, worker in enumerate(self._pool.workers):
            if worker is not None:  # a slot the pool has not grown to yet has none
                self._watch(worker_id)
        spec = self._pool.spec
        if (
            spec.workers == 0
            and spec.autoscale_every > 0
            and len(self._pool.plan) > 1
            and (sum(self._pool.lane_counts) > len(self._pool.plan) or running(self._pool.plan) < len(self._pool.plan))
        ):  # else no packing differs, and the pool cannot grow
            self._scaler = asyncio.get_running_loop().create_task(self._autoscale(spec.autoscale_every))
            self._scaler.add_done_callback(self._scaler_done)

    def unwatch_all(self) -> None:
        loop = asyncio.get_running_loop()
        for worker in self._pool.workers:
            if worker is not None:
                loop.remove_reader(worker.sentinel)

    async def restart_all(self, before_start: Callable[[], None]) -> None:
        """Stop every worker, run `before_start` (e.g. move the cursors), start them all again."""
        async with self._moving:
            await self._restart_all(before_start)

    async def _restart_all(self, before_start: Callable[[], None]) -> None:
        self.unwatch_all()
        if self._tasks:  # a replacement under way finishes first, or two workers would share its rings
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self.unwatch_all()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._pool.stop_workers)
        before_start()
        for worker_id, lanes in enumerate(self._pool.plan):
            if lanes:
                await self._start(worker_id)

    def replace_lane(self, source: int, lane: int, why: str) -> None:
        """The lane's ring failed its checks (pool/intake.py): stop the worker serving it, which
        the supervision then replaces as a dead one (its rings reset, at the cursors; it counts
        as a restart). Safe from any thread. A lane between two workers (a move) has no
        producer: its ring is reset here."""
        worker_id = self._pool.worker_of(source, lane)
        worker = None if worker_id is None else self._pool.workers[worker_id]
        if worker is not None and worker.is_alive():
            self._why[worker_id] = why  # type: ignore[index]
            worker.kill()
            return
        with self._pool.ring_lock:
            self._pool.rings[(source, lane)].reset()
        log.warning("%s: reset it (no worker was serving the lane)", why)

    def _watch(self, worker_id: int) -> None:
        worker = self._pool.started(worker_id)
        asyncio.get_running_loop().add_reader(worker.sentinel, self._on_exit, worker_id)

    def _on_exit(self, worker_id: int) -> None:
        worker = self._pool.workers[worker_id]
        if worker is None:
            return  # the pool shrank and stopped it
        asyncio.get_running_loop().remove_reader(worker.sentinel)
        task = asyncio.get_running_loop().create_task(self._replace(worker_id))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self._fail("worker supervision", exc)

    async def _replace(self, worker_id: int) -> None:
        loop = asyncio.get_running_loop()
        worker = self._pool.workers[worker_id]
        if worker is None:
            return  # the pool shrank and stopped it
        code = await loop.run_in_executor(None, worker.join, _JOIN_DEAD_S)  # the exit code, off the loop
        if code == 0 or self._pool.workers[worker_id] is not worker:
            return  # its lanes are done, or it was replaced meanwhile (restart_all)
        sources = ", ".join(f"'{s}'" for s in self._pool.sources_of(worker_id))
        cause = f"worker {worker.pid} for source {sources} {describe_exit(code)}"
        if worker_id in self._why:
            cause = f"{self._why.pop(worker_id)}; worker {worker.pid} for source {sources} stopped"
        if self._pool.restarts[worker_id] >= self._max_restarts:
            raise SourceFailed(
                sources.strip("'"), f"{cause}; gave up after {self._max_restarts} restarts (--max-restarts)"
            )
        self._pool.restarts[worker_id] += 1
        log.warning(
            "%s; restarting it at the source cursor (restart %d of %d)",
            cause,
            self._pool.restarts[worker_id],
            self._max_restarts,
        )
        await self._start(worker_id)

    async def _start(self, worker_id: int, keep_rings: bool = False) -> None:
        """A fresh worker for worker_id's lanes. After a crash (or to move the cursors) its rings
        are emptied and it starts at its sources' cursors, which cannot move until it writes.
        A re-split keeps them (`keep_rings`): the planner reads on from the records the old
        worker wrote, and each lane goes on after its ring's newest record, so a move neither
        stalls delivery nor redoes work. The positions are read here, on the loop, where the
        planner reads the rings, after the old worker has stopped."""
        if keep_rings:
            for key in self._pool.plan[worker_id]:
                self._pool.rings[key].clear_release()
            starts = {(s, lane): self._intakes[s].resume_at(lane) for s, lane in self._pool.plan[worker_id]}
        else:
            self._pool.reset_rings(worker_id)
            starts = {(s, lane): self._intakes[s].cursor for s, lane in self._pool.plan[worker_id]}
        await asyncio.get_running_loop().run_in_executor(
            None, self._pool.start, worker_id, lambda source, lane: starts[(source, lane)]
        )
        self._watch(worker_id)

    async def close(self) -> None:
        """Stop watching and scaling; wait for a replacement under way (it is quick) so none
        starts after."""
        if self._scaler is not None:
            self._scaler.cancel()
            await asyncio.gather(self._scaler, return_exceptions=True)
        self.unwatch_all()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- the autoscaler ----------------------------------------------------------------------
    async def replan(self, plan: list[list[tuple[int, int]]]) -> tuple[int, int]:
        """Serve the lanes with packing `plan` (laid out by autoscale.keep_in_place) with every
        worker running on: each lane that changes worker is let go by the old one (ring
        handover), then the new one takes it on (its inbox) and goes on after the ring's newest
        record; the planner reads the rings throughout. A worker that does not let go within
        _RELEASE_S (a transform busy for that long), or has gone, is stopped and started with
        its new lanes instead. Returns the lanes moved and the workers restarted."""
        async with self._moving:
            await self._settle()
            carried = moves(self._pool.plan, plan)
            before = list(self._pool.workers)
            for lanes in carried.released.values():
                for key in lanes:
                    self._pool.rings[key].ask_release()
            late = await self._await_release(carried.released)
            await self._settle()  # a worker that died meanwhile was restarted with its old lanes
            late += [w for w in carried.released if self._pool.workers[w] is not before[w] and w not in late]
            if late:
                await self._stop(late)
            self._pool.set_plan(plan)
            restart = set(late)
            for worker_id, lanes in carried.taken.items():
                if worker_id not in restart and not self._take_on(worker_id, lanes):
                    restart.add(worker_id)
            if restart - set(late):
                await self._stop(sorted(restart - set(late)))
            await asyncio.gather(*(self._start(worker_id, keep_rings=True) for worker_id in sorted(restart)))
            emptied = [i for i, lanes in enumerate(plan) if not lanes and self._pool.workers[i] is not None]
            if emptied:  # the pool shrank: these let every lane go
                await self._stop(emptied)
                for worker_id in emptied:
                    self._pool.workers[worker_id] = None
            return sum(map(len, carried.taken.values())), len(restart)

    def _take_on(self, worker_id: int, lanes: list[tuple[int, int]]) -> bool:
        """Send a running worker lanes that have been let go; False if it is gone."""
        worker = self._pool.workers[worker_id]
        if worker is None:
            return False
        for key in lanes:
            self._pool.rings[key].clear_release()
        configs = tuple(self._pool.lane_config(s, lane, self._intakes[s].resume_at(lane)) for s, lane in lanes)
        return worker.take_on(configs)

    async def _settle(self) -> None:
        if self._tasks:  # a replacement under way finishes first
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _stop(self, worker_ids: list[int]) -> None:
        """Stop these workers on purpose: their exits must not restart them."""
        loop = asyncio.get_running_loop()
        for worker_id in worker_ids:
            worker = self._pool.workers[worker_id]
            if worker is not None:
                loop.remove_reader(worker.sentinel)
        await loop.run_in_executor(None, self._pool.stop_workers, worker_ids)

    async def _await_release(self, released: dict[int, list[tuple[int, int]]]) -> list[int]:
        """Wait until every worker asked to let lanes go has; those that have not by
        _RELEASE_S."""
        deadline = asyncio.get_running_loop().time() + _RELEASE_S
        waiting = dict(released)
        while waiting:
            waiting = {w: keys for w, keys in waiting.items() if not all(self._pool.rings[k].released for k in keys)}
            if not waiting or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(_RELEASE_POLL_S)
        if waiting:
            log.warning("workers %s did not let their lanes go in %.0fs; restarting them", sorted(waiting), _RELEASE_S)
        return sorted(waiting)

    def _counters(self) -> list[tuple[float, int, int, int, float]]:
        """Per source: (CPU s, tokens written) of its lanes, tokens taken, empty polls, busy
        wall s of its lanes; all only grow."""
        out = []
        for intake in self._intakes:
            work = [ring.work() for ring in intake.rings]
            cpu, written, busy = (sum(w[k] for w in work) for k in range(3))
            out.append((cpu, int(written), intake.tokens, intake.empty_polls, busy))
        return out

    async def _autoscale(self, every: float) -> None:
        pool, names = self._pool, [intake.catalog.name for intake in self._intakes]
        costs: list[float | None] = [None] * len(self._intakes)
        taken = [0.0] * len(self._intakes)
        last = self._counters()
        pool.scaling = {"autoscale": True, "every_s": every, "moves": 0, "costs": costs}
        # the first window holds the workers' start and the shuffle windows filling, when every
        # source starves for a while whatever the ranks consume: the pool grows from the second
        first = True
        while True:
            await asyncio.sleep(every)
            now = self._counters()
            windows = _windows(last, now)
            last = now
            costs, taken = update_costs(costs, windows), update_taken(taken, windows)
            pool.scaling["costs"] = costs
            need = demands(costs, taken, windows)
            workers = running(pool.plan)
            plan: list[list[tuple[int, int]]] | None = None
            if not first and any(w.starved for w in windows) and saturated(windows, workers, every):
                plan = grow(pool.plan, pool.lane_counts, need or pool.spec.weights())
                if plan:
                    log.info("autoscale: sources starve, every worker busy: %d -> %d workers", workers, running(plan))
            elif not first and idle(windows, workers, every):
                plan = shrink(pool.plan, pool.lane_counts, need or pool.spec.weights())
                if plan:
                    log.info(
                        "autoscale: workers mostly idle, no source starves: %d -> %d workers", workers, running(plan)
                    )
            elif need:
                plan = resplit(pool.plan, pool.lane_counts, need, workers, MARGIN)
            first = False
            if not plan:
                continue
            before = workers_per_source(pool.plan, len(names))
            after = workers_per_source(plan, len(names))
            log.info(
                "autoscale: workers per source %s (cost in CPU us per 1000 tokens: %s)",
                ", ".join(f"{n} {b}->{a}" for n, b, a in zip(names, before, after)),
                ", ".join(f"{n} {c * 1e9:.0f}" for n, c in zip(names, costs) if c is not None),
            )
            moved, restarted = await self.replan(plan)
            log.info("autoscale: %d lanes changed workers, %d workers restarted", moved, restarted)
            pool.scaling["moves"] += 1
            # the window after a move measures the moved lanes' new workers starting and their
            # rings refilling, not the sources' steady cost: it is left out
            await asyncio.sleep(every)
            last = self._counters()

    def _scaler_done(self, task: asyncio.Task) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self._fail("the autoscaler", exc)


def _windows(
    last: list[tuple[float, int, int, int, float]], now: list[tuple[float, int, int, int, float]]
) -> list[Window]:
    """Each source's window from two readings of _counters. Starved: the planner found its rings
    empty at least _STARVED_POLLS times, and at least half as often as for the most starved."""
    polls = [b[3] - a[3] for a, b in zip(last, now)]
    threshold = max(_STARVED_POLLS, max(polls, default=0) / 2)
    return [
        Window(
            cpu_s=max(0.0, b[0] - a[0]),
            produced=max(0, b[1] - a[1]),
            taken=b[2] - a[2],
            starved=p >= threshold,
            busy_s=max(0.0, b[4] - a[4]),
        )
        for a, b, p in zip(last, now, polls)
    ]
