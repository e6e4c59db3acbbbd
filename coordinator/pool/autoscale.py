"""Split the worker budget among sources by what each costs to produce; pure.

Lanes are fixed for the whole job (omniload.order.lane_of: a source's lanes take turns), so which
worker serves a lane never changes the data: only the packing of lanes onto workers moves.
A source's demand is the CPU its consumption needs: the tokens the planner took from it over
the last window times its measured cost per token (its workers' CPU time / tokens they wrote,
smoothed). Lanes are packed onto the budget's workers longest-processing-time first, so the
busiest worker carries as little demand as it can; a costly source's lanes then spread over
several workers while cheap sources share one.

A new packing replaces the one in place only when it promises at least `margin` more
throughput (the busiest worker's demand falls by that factor): hysteresis, so the split
settles instead of chasing noise. A source whose rings ran empty while the planner waited on
it (starved) counts its demand STARVED_BOOST times: it gets workers first, and keeps gaining
them window after window while it stays starved.

The budget (the CPUs less the ranks' reserve) is what the pool may grow to, not what it
starts with: a job starts with START_WORKERS and doubles its running workers while a source
starves and the running ones are busy (GROWTH_BUSY of their time producing), and halves them
while no source starves and they are mostly idle (under SHRINK_BUSY, so that the halved pool
stays under GROWTH_BUSY: no see-saw). So a pool is as large as the ranks' consumption needs:
one BPE worker feeds 8 ranks at 10 steps/s of 2k tokens, and sized by CPUs alone a 64-core
node ran 63 workers of 30-40 MB for them. The lanes are the budget's from the start (they fix
the data's order), so growing or shrinking only moves them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omniload.coordinator.pool.lane_split import assign_lanes

Plan = list[list[tuple[int, int]]]  # workers, each the (source, lane) pairs it produces

MAX_AUTO_LANES = 4  # lanes per source under autoscaling: each is a ring and a reader's state
STARVED_BOOST = 2.0
MARGIN = 0.25  # a re-split must promise this much more throughput
COST_SMOOTHING = 0.5  # weight of the newest window in a source's cost per token
TAKEN_MEMORY = 0.8  # what a window's tokens taken still count one window later (the planner reads in bursts)
MIN_TOKENS = 20_000  # a window with fewer tokens written says little about the cost (mostly idle polling)
START_WORKERS = 1  # a --workers auto pool starts with this many running workers, and grows
GROWTH_BUSY = 0.8  # ... while a source starves and the running workers produce this share of the time
SHRINK_BUSY = 0.3  # and halves them while none starves and they produce less than this share


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """What one source did over the last window (deltas of the lane and intake counters)."""

    cpu_s: float  # CPU seconds its lanes' producers spent
    produced: int  # tokens its lanes wrote into their rings
    taken: int  # tokens the planner took from its rings
    starved: bool  # the planner found its rings empty while it waited on it
    busy_s: float = 0.0  # wall seconds its lanes kept their workers producing (waits on reads included)


def auto_budget(cpus: int, reserve: int) -> int:
    """Worker processes for `--workers auto`: the CPUs left after the ranks' reserve, at least one."""
    return max(1, cpus - reserve)


def auto_lanes(num_sources: int, budget: int) -> list[int]:
    """Lanes per source under autoscaling: enough that a source can spread over several workers,
    but about 4 lanes per worker in all at most (each lane is a ring and a reader's state):
    min(MAX_AUTO_LANES, budget, ceil(4 * budget / sources)), at least one."""
    per_source = -(-4 * budget // max(1, num_sources))
    return [max(1, min(MAX_AUTO_LANES, budget, per_source))] * num_sources


def initial_plan(weights: Sequence[float], workers: int, reserve: int, cpus: int, grows: bool = True) -> Plan:
    """The plan a job starts with. `workers` > 0: that many, split by weight once
    (coordinator.lanes); 0 (auto): a slot for each worker of the budget (the CPUs less
    `reserve`), START_WORKERS of them running (the rest empty until the pool grows), or every
    one where the pool does not autoscale (`grows` False), the lanes packed by weight until
    the sources' costs are measured."""
    if workers:
        return assign_lanes(weights, workers)
    budget = auto_budget(cpus, reserve)
    start = min(budget, START_WORKERS) if grows else budget
    return _slots(pack(auto_lanes(len(weights), budget), list(weights), start), budget)


def running(plan: Plan) -> int:
    """Workers of `plan` that serve lanes (a grown-to slot is empty until then)."""
    return sum(1 for worker in plan if worker)


def _slots(plan: Plan, budget: int) -> Plan:
    return plan + [[] for _ in range(budget - len(plan))]


def pack(lanes: Sequence[int], demand: Sequence[float], budget: int) -> Plan:
    """At most `budget` workers, every lane on exactly one, packed longest-processing-time first
    by each lane's share of its source's demand. Deterministic: ties go to the lower index."""
    items = sorted(
        ((demand[s] / lanes[s], s, j) for s in range(len(lanes)) for j in range(lanes[s])),
        key=lambda item: (-item[0], item[1], item[2]),
    )
    n = min(budget, len(items))
    workers: Plan = [[] for _ in range(n)]
    load = [0.0] * n
    for share, s, j in items:
        w = min(range(n), key=lambda i: (load[i], len(workers[i]), i))
        workers[w].append((s, j))
        load[w] += share
    return [sorted(w) for w in workers]


def busiest(plan: Plan, lanes: Sequence[int], demand: Sequence[float]) -> float:
    """The largest demand one worker of `plan` carries: what bounds the job's token rate."""
    return max((sum(demand[s] / lanes[s] for s, _ in worker) for worker in plan), default=0.0)


def update_costs(costs: Sequence[float | None], windows: Sequence[Window]) -> list[float | None]:
    """Each source's CPU seconds per token, smoothed; unchanged where it wrote fewer than
    MIN_TOKENS (its rings full, its workers only looked at them)."""
    updated: list[float | None] = []
    for cost, window in zip(costs, windows):
        if window.produced < MIN_TOKENS:
            updated.append(cost)
            continue
        fresh = window.cpu_s / window.produced
        updated.append(fresh if cost is None else (1 - COST_SMOOTHING) * cost + COST_SMOOTHING * fresh)
    return updated


def update_taken(taken: Sequence[float], windows: Sequence[Window]) -> list[float]:
    """Tokens taken per source, recent windows counting most: the planner reads a source's
    shuffle window in bursts, so one window alone says little about the mixture."""
    return [TAKEN_MEMORY * t + w.taken for t, w in zip(taken, windows)]


def demands(costs: Sequence[float | None], taken: Sequence[float], windows: Sequence[Window]) -> list[float] | None:
    """CPU each source's consumption needs (recent tokens taken x cost per token); None until
    every source that was consumed has a measured cost (a guess would move workers for nothing)."""
    out = []
    for cost, tokens, window in zip(costs, taken, windows):
        if tokens and cost is None:
            return None
        need = tokens * (cost or 0.0)
        out.append(need * STARVED_BOOST if window.starved else need)
    return out if any(out) else None


def resplit(plan: Plan, lanes: Sequence[int], demand: Sequence[float], workers: int, margin: float) -> Plan | None:
    """A better packing for `demand` on `workers` of plan's slots, laid out so that as many
    workers as can keep running (keep_in_place); None when it would not gain `margin`."""
    proposal = pack(lanes, demand, workers)
    if busiest(plan, lanes, demand) <= (1 + margin) * busiest(proposal, lanes, demand):
        return None
    return keep_in_place(plan, _slots(proposal, len(plan)))


def grow(plan: Plan, lanes: Sequence[int], demand: Sequence[float]) -> Plan | None:
    """Twice the running workers, at most every slot, packed by `demand` and laid out as
    resplit's; None when every slot runs."""
    workers = running(plan)
    if workers >= len(plan):
        return None
    return keep_in_place(plan, _slots(pack(lanes, demand, min(len(plan), 2 * workers)), len(plan)))


def shrink(plan: Plan, lanes: Sequence[int], demand: Sequence[float]) -> Plan | None:
    """Half the running workers (at least START_WORKERS), packed by `demand` and laid out as
    resplit's: the freed slots' workers let their lanes go and stop; None at START_WORKERS."""
    workers = running(plan)
    if workers <= START_WORKERS:
        return None
    return keep_in_place(plan, _slots(pack(lanes, demand, max(START_WORKERS, workers // 2)), len(plan)))


def idle(windows: Sequence[Window], workers: int, seconds: float) -> bool:
    """No source starved and the running workers spent under SHRINK_BUSY of the window producing."""
    busy = sum(w.busy_s for w in windows)
    return not any(w.starved for w in windows) and busy < SHRINK_BUSY * workers * seconds


def saturated(windows: Sequence[Window], workers: int, seconds: float) -> bool:
    """The running workers spent at least GROWTH_BUSY of the window producing (wall time, so a
    worker waiting on a store's reads counts as busy): more of them would produce more."""
    return sum(w.busy_s for w in windows) >= GROWTH_BUSY * workers * seconds


def keep_in_place(old: Plan, new: Plan) -> Plan:
    """`new`'s workers ordered so that each sits at the index of the old worker that already
    serves most of its lanes (the largest first; ties to the lower index): the fewest lanes
    change workers, and a costly source's lanes, spread out to workers of their own, stay with
    the producers they have."""
    placed: list[list[tuple[int, int]] | None] = [None] * len(new)
    rest = []
    for worker in sorted(new, key=len, reverse=True):  # (stable: ties keep new's order)
        free = [i for i in range(len(new)) if placed[i] is None]
        shared = [len(set(worker) & set(old[i])) if i < len(old) else 0 for i in free]
        best = max(range(len(free)), key=lambda j: (shared[j], -free[j]))
        if shared[best]:
            placed[free[best]] = worker
        else:
            rest.append(worker)
    spare = iter(rest)
    return [w if w is not None else next(spare) for w in placed]


@dataclass(frozen=True, slots=True)
class Moves:
    """How a re-split from one plan to the next is carried out: lanes handed from worker to
    worker, every worker running on."""

    released: dict[int, list[tuple[int, int]]]  # the lanes each worker lets go
    taken: dict[int, list[tuple[int, int]]]  # the lanes each worker takes on, once let go


def moves(old: Plan, new: Plan) -> Moves:
    released: dict[int, list[tuple[int, int]]] = {}
    taken: dict[int, list[tuple[int, int]]] = {}
    for i in range(max(len(old), len(new))):
        before, after = set(old[i]) if i < len(old) else set(), set(new[i]) if i < len(new) else set()
        if before - after:
            released[i] = sorted(before - after)
        if after - before:
            taken[i] = sorted(after - before)
    return Moves(released=released, taken=taken)


def workers_per_source(plan: Plan, num_sources: int) -> list[int]:
    """How many workers serve each source: the split as status shows it."""
    return [sum(1 for worker in plan if any(s == source for s, _ in worker)) for source in range(num_sources)]
