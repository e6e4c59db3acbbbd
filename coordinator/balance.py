"""Compute-balanced assignment of a step's segments to data-parallel ranks and rows; pure.

The mixture decides which segments are in a step; this only decides where each one goes.
Every rank has `rows` rows of `seq_len` tokens, and a segment must fit inside one row.

1. Greedy longest-processing-time: segments by cost, highest first (carried segments before
   fresh ones, so nothing waits more than it must). Each goes to the cheapest rank that has
   a row it fits in, into the fullest such row (best fit keeps whole rows free for long
   segments). A segment that fits nowhere is carried to the next step.
2. Refinement: while it lowers the most expensive rank's cost, move one of that rank's
   segments to the cheapest rank, or swap it with a cheaper segment there. Each move must fit
   the rows and bring both ranks under the old maximum.

The lower bound on the most expensive rank is max(mean rank cost, largest single segment).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

_MAX_REFINE = 4096
_MAX_PROBES = 64  # ranks tried for one segment before it is carried


@dataclass(frozen=True, slots=True)
class Assignment:
    rank: np.ndarray  # per segment: data-parallel rank, or -1 (carried)
    row: np.ndarray  # per segment: row within the rank, or -1
    cost: np.ndarray  # per rank: total cost

    def figures(self, costs: np.ndarray) -> dict[str, float]:
        placed = costs[self.rank >= 0]
        mean = float(self.cost.mean()) if len(self.cost) else 0.0
        bound = max(mean, float(placed.max()) if len(placed) else 0.0)
        worst = float(self.cost.max()) if len(self.cost) else 0.0
        return {"max_cost": worst, "mean_cost": mean, "lower_bound": bound,
                "imbalance": worst / mean if mean else 1.0, "to_bound": worst / bound if bound else 1.0}


def assign(lengths: np.ndarray, costs: np.ndarray, carried: int, dp: int, rows: int, seq_len: int,
           groups: list[np.ndarray] = (), may_wait: np.ndarray | None = None) -> Assignment:
    """Place segments; the first `carried` of them were carried over and go first.

    `groups`: segments that must share one rank, each in a whole row of its own, in order
    (a long document kept whole). `may_wait`: segments that may be carried rather than put
    where they would lift their rank more than 10% above the lower bound (--balance-window).
    """
    n = len(lengths)
    rank_of = np.full(n, -1, dtype=np.int64)
    row_of = np.full(n, -1, dtype=np.int64)
    free = np.full((dp, rows), seq_len, dtype=np.int64)
    rank_cost = np.zeros(dp, dtype=np.float64)
    pinned = np.zeros(n, dtype=bool)
    for group in sorted(groups, key=lambda g: -costs[g].sum()):
        pinned[group] = True
        _place_group(group, costs, rank_of, row_of, free, rank_cost, seq_len)
    order = np.concatenate([_by_cost(costs[:carried]), carried + _by_cost(costs[carried:])])
    order = order[~pinned[order]]
    limit = 1.1 * max(costs.sum() / dp, costs.max(initial=0.0))
    heap = [(rank_cost[r], r) for r in range(dp)]
    heapq.heapify(heap)
    for i in order:
        length = int(lengths[i])
        if may_wait is not None and may_wait[i] and heap and heap[0][0] + costs[i] > limit:
            continue  # even the cheapest rank would go well over the bound: wait for a later step
        tried = []
        while heap and len(tried) < _MAX_PROBES:
            entry = heapq.heappop(heap)
            r = entry[1]
            row = _best_row(free[r], length)
            if row >= 0:
                free[r, row] -= length
                rank_cost[r] += costs[i]
                rank_of[i], row_of[i] = r, row
                heapq.heappush(heap, (rank_cost[r], r))
                break
            tried.append(entry)
        for entry in tried:
            heapq.heappush(heap, entry)
    _refine(lengths, costs, rank_of, row_of, free, rank_cost, pinned)
    return Assignment(rank_of, row_of, rank_cost)


def _place_group(group, costs, rank_of, row_of, free, rank_cost, seq_len) -> None:
    """All of `group` into whole free rows of the cheapest rank that has enough; else carried."""
    whole = (free == seq_len).sum(axis=1)
    candidates = np.flatnonzero(whole >= len(group))
    if not len(candidates):
        return
    r = int(candidates[np.argmin(rank_cost[candidates])])
    rows = np.flatnonzero(free[r] == seq_len)[: len(group)]
    for i, row in zip(group, rows):
        rank_of[i], row_of[i] = r, row
        free[r, row] = 0  # the row is the chunk's alone, even when the chunk is shorter
    rank_cost[r] += costs[group].sum()


def _by_cost(costs: np.ndarray) -> np.ndarray:
    return np.argsort(-costs, kind="stable")


def _best_row(free_rows: np.ndarray, length: int) -> int:
    fits = np.flatnonzero(free_rows >= length)
    if not len(fits):
        return -1
    return int(fits[np.argmin(free_rows[fits])])


def _refine(lengths, costs, rank_of, row_of, free, rank_cost, pinned) -> None:
    if len(rank_cost) < 2:
        return
    members = {r: list(np.flatnonzero((rank_of == r) & ~pinned)) for r in range(len(rank_cost))}
    for _ in range(_MAX_REFINE):
        hi, lo = int(np.argmax(rank_cost)), int(np.argmin(rank_cost))
        gap = rank_cost[hi] - rank_cost[lo]
        if gap <= 0 or not _improve(hi, lo, gap, lengths, costs, rank_of, row_of, free, rank_cost, members):
            return


def _improve(hi, lo, gap, lengths, costs, rank_of, row_of, free, rank_cost, members) -> bool:
    """The move or swap between ranks hi and lo that best halves their gap; False if none helps."""
    best = None  # (distance from gap/2, x, y or None, row in lo)
    lo_rows = free[lo]
    for x in members[hi]:
        cx, lx, rx = costs[x], lengths[x], row_of[x]
        if 0 < cx < gap:  # move x
            row = _best_row(lo_rows, lx)
            if row >= 0 and (best is None or abs(cx - gap / 2) < best[0]):
                best = (abs(cx - gap / 2), x, None, row)
        for y in members[lo]:
            delta = cx - costs[y]
            if not 0 < delta < gap:
                continue
            ly, ry = lengths[y], row_of[y]
            if free[hi, rx] + lx >= ly and lo_rows[ry] + ly >= lx and (best is None or abs(delta - gap / 2) < best[0]):
                best = (abs(delta - gap / 2), x, y, ry)
    if best is None:
        return False
    _, x, y, row = best
    rx = row_of[x]
    if y is not None:
        free[hi, rx] += lengths[x] - lengths[y]
        free[lo, row] += lengths[y] - lengths[x]
        rank_cost[hi] += costs[y] - costs[x]
        rank_cost[lo] += costs[x] - costs[y]
        rank_of[y], row_of[y] = hi, rx
        members[lo].remove(y)
        members[hi].append(y)
    else:
        free[hi, rx] += lengths[x]
        free[lo, row] -= lengths[x]
        rank_cost[hi] -= costs[x]
        rank_cost[lo] += costs[x]
    rank_of[x], row_of[x] = lo, row
    members[hi].remove(x)
    members[lo].append(x)
    return True
