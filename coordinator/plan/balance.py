"""Compute-balanced assignment of a step's segments to data-parallel ranks and rows; pure.

The mixture decides which segments are in a step; this only decides where each one goes.
Every rank has `rows` rows of `seq_len` tokens, and a segment must fit inside one row.

1. Greedy longest-processing-time, in rounds of `dp` segments so that it vectorizes: segments
   by cost, highest first (carried segments before fresh ones, so nothing waits more than it
   must); in each round the most expensive goes to the cheapest rank, into the fullest row it
   fits (best fit keeps whole rows free for long segments). A segment that does not fit its
   rank goes to the cheapest rank with room; one that fits nowhere is carried to the next step.
2. Refinement: while it lowers the most expensive rank's cost, move one of that rank's
   segments to the cheapest rank, or swap it with a cheaper segment there. Each move must fit
   the rows and bring both ranks under the old maximum.

The lower bound on the most expensive rank is max(mean rank cost, largest single segment).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

_MAX_REFINE = 4096
_RETRY_ROUNDS = 4
# assign's greedy pass runs as plain Python up to this many ranks: on 2 cores a whole planning
# step cost less so at dp 12-24 with 1, 4 and 16 rows a rank, at dp 32 only with 4, and more
# at 48 (measured with scripts/bench_balance.py's planner timing, 2026-11-25)
_PYTHON_DP = 24

Ints = NDArray[np.int64]  # segment indices, lengths, ranks, rows, free tokens per row
Floats = NDArray[np.float64]  # costs
Mask = NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Assignment:
    rank: Ints  # per segment: data-parallel rank, or -1 (carried)
    row: Ints  # per segment: row within the rank, or -1
    cost: Floats  # per rank: total cost

    def balance(self, costs: Floats) -> dict[str, float]:
        return balance_stats(self.cost, costs[self.rank >= 0])


def balance_stats(rank_cost: Floats, placed: Floats) -> dict[str, float]:
    """How even a step is: max and mean rank cost, and the lower bound max(mean, the costliest
    item placed) that no assignment can beat."""
    mean = float(rank_cost.mean()) if len(rank_cost) else 0.0
    bound = max(mean, float(placed.max()) if len(placed) else 0.0)
    worst = float(rank_cost.max()) if len(rank_cost) else 0.0
    return {
        "max_cost": worst,
        "mean_cost": mean,
        "lower_bound": bound,
        "imbalance": worst / mean if mean else 1.0,
        "to_bound": worst / bound if bound else 1.0,
    }


def assign(
    lengths: Ints,
    costs: Floats,
    carried: int,
    dp: int,
    rows: int,
    seq_len: int,
    groups: Sequence[Ints] = (),
    may_wait: Mask | None = None,
) -> Assignment:
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
    greedy = _greedy_python if dp <= _PYTHON_DP else _greedy_rounds
    greedy(
        order,
        lengths,
        costs,
        rank_of,
        row_of,
        free,
        rank_cost,
        1.1 * max(costs.sum() / dp, costs.max(initial=0.0)),
        may_wait,
    )
    _refine(lengths, costs, rank_of, row_of, free, rank_cost, pinned)
    return Assignment(rank_of, row_of, rank_cost)


def _place_group(
    group: Ints, costs: Floats, rank_of: Ints, row_of: Ints, free: Ints, rank_cost: Floats, seq_len: int
) -> None:
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


def _greedy_rounds(
    order: Ints,
    lengths: Ints,
    costs: Floats,
    rank_of: Ints,
    row_of: Ints,
    free: Ints,
    rank_cost: Floats,
    limit: float,
    may_wait: Mask | None,
) -> None:
    """LPT in rounds: the next `dp` segments by cost go to the ranks by cost, most expensive
    segment to the cheapest rank, each into its best-fitting row. Segments that do not fit
    their rank try again with the cheapest ranks, until a try places none (at most
    _RETRY_ROUNDS), then one by one where there is room; what fits nowhere is carried.
    Vectorized per round, for many ranks; up to _PYTHON_DP, _greedy_python does the same in
    plain Python, where a round of numpy calls (about 25 us) costs more than the loops: at dp=2
    the rounds were a fifth of a 2-rank coordinator's CPU."""
    dp = len(rank_cost)
    for start in range(0, len(order), dp):
        items = order[start : start + dp]
        if may_wait is not None:
            waiting = may_wait[items] & (rank_cost.min() + costs[items] > limit)
            items = items[~waiting]  # even the cheapest rank would go well over the bound: wait
        ranks = np.argsort(rank_cost, kind="stable")
        for _ in range(_RETRY_ROUNDS):
            if not len(items):
                break
            left = _place_round(items, ranks[: len(items)], lengths, costs, rank_of, row_of, free, rank_cost)
            if len(left) == len(items):
                break  # nothing placed: another try would pair the same items with the same ranks
            items = left
        if len(items):
            _place_anywhere(items, lengths, costs, rank_of, row_of, free, rank_cost)


def _greedy_python(
    order: Ints,
    lengths: Ints,
    costs: Floats,
    rank_of: Ints,
    row_of: Ints,
    free: Ints,
    rank_cost: Floats,
    limit: float,
    may_wait: Mask | None,
) -> None:
    """_greedy_rounds step for step (the same order, the same float additions), so the same
    assignment: a unit test runs both."""
    dp = len(rank_cost)
    room, cost = free.tolist(), rank_cost.tolist()
    length_of, cost_of = lengths.tolist(), costs.tolist()
    waits = may_wait.tolist() if may_wait is not None else None
    order_list = order.tolist()

    def place(i: int, r: int, row: int) -> None:
        room[r][row] -= length_of[i]
        cost[r] += cost_of[i]
        rank_of[i], row_of[i] = r, row

    for start in range(0, len(order_list), dp):
        items = order_list[start : start + dp]
        if waits is not None:
            least = min(cost)
            items = [i for i in items if not (waits[i] and least + cost_of[i] > limit)]
        ranks = sorted(range(dp), key=cost.__getitem__)  # stable, as argsort(kind="stable")
        for _ in range(_RETRY_ROUNDS):
            if not items:
                break
            # item k to rank k: the ranks differ, so every row is found before any is filled
            rows = [_fullest_fitting(room[r], length_of[i]) for i, r in zip(items, ranks)]
            missed = rows.count(-1)
            if missed == len(rows):
                break  # another try would pair the same items with the same ranks
            for i, r, row in zip(items, ranks, rows):
                if row >= 0:
                    place(i, r, row)
            items = [i for i, row in zip(items, rows) if row < 0] if missed else []
        for i in items:  # as _place_anywhere: the cheapest rank with room (the first of equals)
            candidates = [r for r in range(dp) if max(room[r]) >= length_of[i]]
            if candidates:
                r = min(candidates, key=cost.__getitem__)
                place(i, r, _fullest_fitting(room[r], length_of[i]))
    free[:] = room
    rank_cost[:] = cost


def _place_round(
    items: Ints, ranks: Ints, lengths: Ints, costs: Floats, rank_of: Ints, row_of: Ints, free: Ints, rank_cost: Floats
) -> Ints:
    """Item k into rank k's best-fitting row where it fits; returns the items that did not."""
    ranks = ranks[: len(items)]
    items_here = items[: len(ranks)]
    need = lengths[items_here]
    rooms = free[ranks]
    fits = rooms >= need[:, None]
    rows = np.argmin(np.where(fits, rooms, np.iinfo(np.int64).max), axis=1)
    ok = fits.any(axis=1)
    placed, at_ranks, at_rows = items_here[ok], ranks[ok], rows[ok]
    free[at_ranks, at_rows] -= need[ok]
    rank_cost[at_ranks] += costs[placed]
    rank_of[placed], row_of[placed] = at_ranks, at_rows
    return np.concatenate([items_here[~ok], items[len(ranks) :]])


def _place_anywhere(
    items: Ints, lengths: Ints, costs: Floats, rank_of: Ints, row_of: Ints, free: Ints, rank_cost: Floats
) -> None:
    """Each of `items` to the cheapest rank with room for it; what fits nowhere is carried."""
    room = free.max(axis=1)
    largest = int(room.max())
    for i in items.tolist():
        length = int(lengths[i])
        if length > largest:
            continue  # carried to the next step
        candidates = np.flatnonzero(room >= length)
        r = int(candidates[np.argmin(rank_cost[candidates])])
        row = _fullest_fitting(free[r].tolist(), length)
        free[r, row] -= length
        rank_cost[r] += costs[i]
        rank_of[i], row_of[i] = r, row
        room[r] = free[r].max()
        largest = int(room.max())


def _by_cost(costs: Floats) -> Ints:
    return np.argsort(-costs, kind="stable")


def _refine(
    lengths: Ints, costs: Floats, rank_of: Ints, row_of: Ints, free: Ints, rank_cost: Floats, pinned: Mask
) -> None:
    if len(rank_cost) < 2:
        return
    movable = np.flatnonzero((rank_of >= 0) & ~pinned)
    by_rank = movable[np.argsort(rank_of[movable], kind="stable")]
    bounds = np.searchsorted(rank_of[by_rank], np.arange(len(rank_cost) + 1))
    members = {r: by_rank[bounds[r] : bounds[r + 1]].tolist() for r in range(len(rank_cost))}
    # The pairs' arithmetic on plain lists: a numpy scalar read costs ~50 ns more than a list's
    # and _improve makes several for each pair of segments (about 5% of a step at dp 64 as numpy,
    # py-spy). rank_cost stays numpy, for argmax and argmin over many ranks.
    lists = _Lists(lengths.tolist(), costs.tolist(), row_of.tolist(), free.tolist())
    for _ in range(_MAX_REFINE):
        hi, lo = int(np.argmax(rank_cost)), int(np.argmin(rank_cost))
        gap = float(rank_cost[hi] - rank_cost[lo])
        if gap <= 0 or not _improve(hi, lo, gap, lists, rank_of, rank_cost, members):
            break
    row_of[:] = lists.row_of
    free[:] = lists.free


@dataclass(slots=True)
class _Lists:
    """_refine's view of segments and rows as lists (the same values as the arrays)."""

    length: list[int]
    cost: list[float]
    row_of: list[int]
    free: list[list[int]]


def _fullest_fitting(rows: list[int], length: int) -> int:
    """The fullest row with room for `length` (the first of equals), or -1."""
    best = -1
    for row, left in enumerate(rows):
        if left >= length and (best < 0 or left < rows[best]):
            best = row
    return best


def _improve(
    hi: int, lo: int, gap: float, lists: _Lists, rank_of: Ints, rank_cost: Floats, members: dict[int, list[int]]
) -> bool:
    """The move or swap between ranks hi and lo that best halves their gap; False if none helps."""
    best: tuple[float, int, int | None, int] | None = None  # (distance from gap/2, x, y or None, row in lo)
    length, cost, row_of = lists.length, lists.cost, lists.row_of
    hi_rows, lo_rows = lists.free[hi], lists.free[lo]
    for x in members[hi]:
        cx, lx, rx = cost[x], length[x], row_of[x]
        if 0 < cx < gap:  # move x
            row = _fullest_fitting(lo_rows, lx)
            if row >= 0 and (best is None or abs(cx - gap / 2) < best[0]):
                best = (abs(cx - gap / 2), x, None, row)
        for y in members[lo]:
            delta = cx - cost[y]
            if not 0 < delta < gap:
                continue
            ly, ry = length[y], row_of[y]
            if hi_rows[rx] + lx >= ly and lo_rows[ry] + ly >= lx and (best is None or abs(delta - gap / 2) < best[0]):
                best = (abs(delta - gap / 2), x, y, ry)
    if best is None:
        return False
    _, x, swap, row = best
    rx = row_of[x]
    if swap is not None:
        hi_rows[rx] += length[x] - length[swap]
        lo_rows[row] += length[swap] - length[x]
        rank_cost[hi] += cost[swap] - cost[x]
        rank_cost[lo] += cost[x] - cost[swap]
        rank_of[swap], row_of[swap] = hi, rx
        members[lo].remove(swap)
        members[hi].append(swap)
    else:
        hi_rows[rx] += length[x]
        lo_rows[row] -= length[x]
        rank_cost[hi] -= cost[x]
        rank_cost[lo] += cost[x]
    rank_of[x], row_of[x] = lo, row
    members[hi].remove(x)
    members[lo].append(x)
    return True
