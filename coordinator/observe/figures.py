"""What a running job looks like: figures per source, per rank and for the planner.

Counters come from where the work happens: intakes count the documents and tokens the
planner reads (a shuffle window is read in bursts, so these rates are bursty), delivery counts
the real tokens of the steps every rank consumed, the planner thread times its steps, ranks report their time
spent waiting in
their ACKs, and the pool knows its workers. The coordinator's tick samples them about once a
second into rates (`Figures.sample`); `snapshot()` is the one view that `omniload status`,
`job.status()`, the Prometheus endpoint and launch's progress line all show.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psutil

from omniload.coordinator.plan_task import PlanTask
from omniload.coordinator.pool.intake import SourceIntake
from omniload.coordinator.pool.worker_pool import WorkerPool
from omniload.coordinator.serve.delivery import Delivery
from omniload.order import groups_per_epoch

SAMPLE_S = 1.0  # rates are measured over at least this long


class Rates:
    """Per-second rates of counters, each from its last two samples at least SAMPLE_S apart."""

    def __init__(self) -> None:
        self._last: dict[Any, tuple[float, float]] = {}
        self.rate: dict[Any, float] = {}

    def sample(self, key: Any, value: float, now: float) -> None:
        seen = self._last.get(key)
        if seen is None:
            self._last[key] = (now, value)
        elif now - seen[0] >= SAMPLE_S:
            self.rate[key] = max(0.0, (value - seen[1]) / (now - seen[0]))
            self._last[key] = (now, value)

    def forget(self, key: Any) -> None:
        self._last.pop(key, None)
        self.rate.pop(key, None)


class Figures:
    def __init__(
        self, job_id: str, names: Sequence[str], intakes: Sequence[SourceIntake], pool: WorkerPool, planner: PlanTask
    ) -> None:
        self._job_id, self._names, self._intakes, self._pool, self._planner = job_id, names, intakes, pool, planner
        self._started = time.monotonic()
        self._rates = Rates()
        self._processes: dict[int, psutil.Process] = {}

    def sample(self, delivery: Delivery | None, now: float) -> None:
        """On the tick: move the rates on."""
        for intake in self._intakes:
            name = intake.catalog.name
            self._rates.sample(("docs", name), intake.docs, now)
            self._rates.sample(("tokens", name), intake.tokens, now)
        pids = {worker.pid for worker in self._pool.workers if worker is not None and worker.pid is not None}
        for gone in set(self._processes) - pids:  # replaced workers: their figures go with them
            del self._processes[gone]
            self._rates.forget(("cpu", gone))
        for pid in pids:
            self._rates.sample(("cpu", pid), self._cpu_seconds(pid), now)
        if delivery is not None:
            self._rates.sample("delivered", delivery.delivered_tokens, now)
            for state in delivery.ranks.values():
                self._rates.sample(("wait", state.rank), state.wait_s, now)

    def snapshot(self, delivery: Delivery | None, stall_message: str | None) -> dict[str, Any]:
        rate = self._rates.rate
        return {
            "job": self._job_id,
            "uptime_s": round(time.monotonic() - self._started, 1),
            "steps": {
                "planned": delivery.planned if delivery else 0,
                "slowest": delivery.slowest if delivery else 0,
                "final": delivery.final if delivery else None,
            },
            "delivered": {
                "tokens": delivery.delivered_tokens if delivery else 0,
                "tokens_per_s": round(rate.get("delivered", 0.0)),
            },
            "sources": [self._source(intake, rate) for intake in self._intakes],
            "ranks": []
            if delivery is None
            else [
                {
                    "rank": s.rank,
                    "step": delivery.consumed(s.rank),
                    "lag": delivery.planned - delivery.consumed(s.rank),
                    "wait_percent": round(100 * min(1.0, rate.get(("wait", s.rank), 0.0)), 1),
                    "credits": s.credits,
                    "connection": s.connection,
                    "via": s.via if s.writer is not None else "",
                }
                for s in delivery.ranks.values()
            ],
            "planner": self._planner_figures(),
            "workers": {
                "count": sum(1 for w in self._pool.workers if w is not None),
                "budget": len(self._pool.plan),  # what --workers auto may grow to
                "autoscale": bool(self._pool.scaling),
                "moves": self._pool.scaling.get("moves", 0),
            },
            "memory_mb": self._memory(),
            "waiting_for": stall_message,
        }

    def _planner_figures(self) -> dict[str, Any]:
        figures = self._planner.progress()
        if "weights" in figures:
            figures["weights"] = dict(zip(self._names, figures["weights"]))
        if "top_doc_share" in figures:
            figures["top_doc_share"] = dict(zip(self._names, figures["top_doc_share"]))
        return figures

    def _source(self, intake: SourceIntake, rate: dict) -> dict[str, Any]:
        name, index = intake.catalog.name, intake.catalog.index
        rings = self._pool.source_rings(index)
        workers = self._pool.workers_of_source(index)
        cpu = sum(rate.get(("cpu", w.pid), 0.0) for w in workers if w is not None)
        per_epoch = groups_per_epoch(len(intake.catalog.shards), intake.interleave)
        cost = self._pool.scaling.get("costs", [None] * (index + 1))[index]
        store = [r.store() for r in rings]
        retries, fetched, held = (sum(f[i] for f in store) for i in range(3))
        return {
            "name": name,
            "docs": intake.docs,
            "tokens": intake.tokens,
            "tokens_written": sum(ring.work()[1] for ring in rings),  # by its workers, taken or not
            # conversations longer than seq_len since the coordinator started (--long-chats)
            "chats_truncated": intake.chats_truncated,
            "chats_dropped": intake.chats_dropped,
            "docs_per_s": round(rate.get(("docs", name), 0.0), 1),
            "tokens_per_s": round(rate.get(("tokens", name), 0.0)),
            "ring_fill": round(sum(r.used() for r in rings) / sum(r.capacity for r in rings), 3),
            "workers": len(workers),
            "worker_cpu_percent": round(100 * cpu, 1),
            "cpu_us_per_ktoken": None if cost is None else round(cost * 1e9, 1),  # measured (autoscale only)
            "restarts": self._pool.restarts_of_source(index),
            "epoch": intake.group // per_epoch,
            "cursor": list(intake.cursor),
            # reads from a store (0 for local files): retried requests, bytes fetched, bytes its
            # lanes' block caches hold now (each lane at most --read-ahead)
            "store_retries": retries,
            "store_fetched_mb": round(fetched / 2**20, 1),
            "read_ahead_mb": round(held / 2**20, 1),
        }

    def _memory(self) -> dict[str, float]:
        """Resident memory of the coordinator and its workers (RSS: cheap to read; the workers'
        shared pages, rings included, are counted in each process that maps them), the
        coordinator's own heap and PSS where Linux tells them (smaps_rollup, well under a
        millisecond), and the rings' read-ahead (their spans, shared by coordinator and workers)."""
        workers = 0
        for worker in self._pool.workers:
            if worker is None or worker.pid is None:
                continue
            try:
                workers += self._process(worker.pid).memory_info().rss
            except psutil.Error:  # it just exited
                pass
        rings = sum(ring.span for ring in self._pool.rings.values())
        return {
            "coordinator": round(psutil.Process().memory_info().rss / 2**20, 1),
            **{f"coordinator_{key}": round(value / 2**20, 1) for key, value in _own_memory().items()},
            "workers": round(workers / 2**20, 1),
            "rings": round(rings / 2**20, 1),
        }

    def _process(self, pid: int) -> psutil.Process:
        """A worker's Process, kept: psutil reads what never changes (its start time) once."""
        return self._processes.get(pid) or self._processes.setdefault(pid, psutil.Process(pid))

    def _cpu_seconds(self, pid: int) -> float:
        try:
            times = self._process(pid).cpu_times()
            return times.user + times.system
        except psutil.Error:  # it just exited; its replacement is sampled from the next tick
            return 0.0


def _own_memory() -> dict[str, int]:
    """This process's heap (private anonymous memory: Python objects, numpy and arrow buffers)
    and PSS, in bytes; empty where /proc/self/smaps_rollup is not there (not Linux)."""
    fields = {"Anonymous:": "heap", "Pss:": "pss"}
    out: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(" ")
                if key in fields:
                    out[fields[key]] = int(rest.split()[0]) << 10
    except OSError:
        pass
    return out
