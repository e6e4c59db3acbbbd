"""Variable token budgets: a step's segments to data-parallel ranks by cost alone; pure.

With --rank-tokens variable a rank has no rows: it receives one packed sequence of the segments
it is given, as long as they add up to (padded by the caller), at most `cap` tokens. So a rank
with a few long, attention-heavy documents takes fewer tokens and one with many short ones
more, and the ranks' costs come out equal. The mixture decides which segments a step holds;
this only decides where each goes.

1. Items: a segment, or all the chunks of a document kept whole (long_docs=bucket), which go to
   one rank together.
2. Longest processing time first, in rounds so that it vectorizes: items by cost, highest
   first (carried ones before fresh ones, so nothing waits more than it must); in each round
   the most expensive goes to the cheapest rank, the next to the next cheapest, and so on, one
   item for each rank still below the lower bound (a rank holding the step's largest document
   takes nothing more while others are below it). An item that would take its rank past `cap`
   goes to the cheapest rank with room; one with room nowhere is carried to the next step.
3. Refinement, while the most expensive rank is above the lower bound by more than
   _GOOD_ENOUGH: first in vectorized passes, every rank above it paired with one of the
   cheapest, each pair moving the item that best halves their gap; then, one at a time, the
   move or swap of an item of the most expensive rank with another rank (any rank where the
   step has few items, else the cheapest) that leaves the higher of the two lowest; where
   none helps and a step has few items, the same with two items on either side (ranks holding
   5-20 segments get stuck on single moves: 4k-8k tokens a rank). These moves count each
   rank's padding (its tokens rounded up to `pad_to`, at `pad_cost` a token): at 4k-8k
   tokens a rank, padding to 128 costs up to 1.5% of a rank, as much as is left to gain.

The lower bound on the most expensive rank is max(mean rank cost, largest item).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from omniload.coordinator.plan.balance import balance_stats
from omniload.coordinator.plan.cost import CostFn

_MOVE_PASSES = 2  # vectorized passes of moves between many pairs of ranks (more moved nothing useful in the bench)
_MAX_REFINE = 64  # then single moves or swaps at most per step (it stops before, see _GOOD_ENOUGH)
_WIDE_CANDIDATES = 1 << 16  # (item, item or rank) pairs a single move or swap may weigh
_GOOD_ENOUGH = 1e-3  # refinement stops once the most expensive rank is within this of the bound
_PAIR_RANKS = 4  # where single moves are stuck, two items are swapped with the cheapest ranks' only

Ints = NDArray[np.int64]
Floats = NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Budgets:
    rank: Ints  # per segment: data-parallel rank, or -1 (carried)
    cost: Floats  # per rank: total cost
    tokens: Ints  # per rank: real tokens

    def balance(self, costs: Floats, groups: Sequence[Ints] = ()) -> dict[str, float]:
        """max/mean rank cost and the max over the lower bound; a group counts as one item."""
        item_cost = costs.copy()
        for group in groups:
            item_cost[group] = 0.0
            item_cost[group[0]] = costs[group].sum()
        return balance_stats(self.cost, item_cost[self.rank >= 0])


def assign_budgets(
    lengths: Ints,
    costs: Floats,
    carried: int,
    dp: int,
    cap: int,
    groups: Sequence[Ints] = (),
    pad_to: int = 1,
    pad_cost: float = 0.0,
) -> Budgets:
    """Each segment to a rank, at most `cap` tokens a rank; the first `carried` go first.
    `groups`: segments that must share one rank (a long document kept whole). A rank's
    tokens are padded up to a multiple of `pad_to` (padded_length), each pad token costing
    `pad_cost` (padding_cost); Budgets.cost is without it."""
    item_len, item_cost, first, members = _items(lengths, costs, groups)
    was_carried = first < carried
    old, fresh = np.flatnonzero(was_carried), np.flatnonzero(~was_carried)
    order = np.concatenate([old[_by_cost(item_cost[old])], fresh[_by_cost(item_cost[fresh])]])
    p = _Placement(item_len, item_cost, dp, cap, _Padding(pad_to, pad_cost))
    _greedy(p, order)
    bound = max(p.rank_cost.sum() / dp, item_cost[p.item_rank >= 0].max(initial=0.0))
    for _ in range(_MOVE_PASSES):
        if not _move_in_pairs(p, bound):
            break
    _refine(p, bound)
    rank = np.full(len(lengths), -1, dtype=np.int64)
    singles = len(item_len) - len(members)
    rank[first[:singles]] = p.item_rank[:singles]
    for group, r in zip(members, p.item_rank[singles:].tolist()):
        rank[group] = r
    return Budgets(rank, p.rank_cost, p.rank_tokens)


def _items(lengths: Ints, costs: Floats, groups: Sequence[Ints]) -> tuple[Ints, Floats, Ints, list[Ints]]:
    """(length, cost, first segment) per item: the segments outside groups, then one per group."""
    grouped = np.zeros(len(lengths), dtype=bool)
    for group in groups:
        grouped[group] = True
    singles = np.flatnonzero(~grouped)
    members = [np.asarray(g, dtype=np.int64) for g in groups]
    item_len = np.concatenate([lengths[singles], [lengths[g].sum() for g in members]]).astype(np.int64)
    item_cost = np.concatenate([costs[singles], [costs[g].sum() for g in members]]).astype(np.float64)
    first = np.concatenate([singles, [int(g.min()) for g in members]]).astype(np.int64)
    return item_len, item_cost, first, members


def _by_cost(costs: Floats) -> Ints:
    return np.argsort(-costs, kind="stable")


@dataclass(frozen=True, slots=True)
class _Padding:
    """What a rank's padding costs: its tokens up to the next multiple of `to` (padded_length
    also pads an empty rank and stops at the cap, which the busiest rank never is or reaches)."""

    to: int
    cost: float

    def __call__(self, tokens: Ints) -> Floats | float:
        return np.asarray(self.cost * ((-tokens) % self.to), dtype=np.float64) if self.cost else 0.0


class _Placement:
    """The items, where each sits (-1: not placed) and what each rank holds, which every stage
    of the assignment reads and changes in place."""

    def __init__(self, item_len: Ints, item_cost: Floats, dp: int, cap: int, padding: _Padding) -> None:
        self.item_len, self.item_cost, self.cap, self.padding = item_len, item_cost, cap, padding
        self.item_rank = np.full(len(item_len), -1, dtype=np.int64)
        self.rank_cost = np.zeros(dp, dtype=np.float64)
        self.rank_tokens = np.zeros(dp, dtype=np.int64)

    def paid(self) -> Floats:
        """Each rank's cost with its padding."""
        return self.rank_cost + self.padding(self.rank_tokens)

    def move(self, items: Ints, to: Ints) -> None:
        """Items (placed or not) to ranks `to`, one each; no two of them leave or reach one rank
        (so plain indexing adds up: a round of LPT, a pass of pairs)."""
        frm = self.item_rank[items]
        was = frm >= 0
        self.rank_cost[frm[was]] -= self.item_cost[items[was]]
        self.rank_tokens[frm[was]] -= self.item_len[items[was]]
        self.rank_cost[to] += self.item_cost[items]
        self.rank_tokens[to] += self.item_len[items]
        self.item_rank[items] = to

    def move_one(self, item: int, to: int) -> None:
        frm = int(self.item_rank[item])
        if frm >= 0:
            self.rank_cost[frm] -= self.item_cost[item]
            self.rank_tokens[frm] -= self.item_len[item]
        self.rank_cost[to] += self.item_cost[item]
        self.rank_tokens[to] += self.item_len[item]
        self.item_rank[item] = to


def _greedy(p: _Placement, order: Ints) -> None:
    """LPT in rounds: the k-th item of a round to the k-th cheapest rank, where it has room.
    A round has as many items as there are ranks below the target (the lower bound): a rank
    that holds the step's largest document takes nothing more while others are below it."""
    dp = len(p.rank_cost)
    target = max(p.item_cost.sum() / dp, p.item_cost.max(initial=0.0))
    start = 0
    while start < len(order):
        below = int(np.count_nonzero(p.rank_cost < target)) or dp  # none below: plain rounds
        items = order[start : start + below]
        start += len(items)
        ranks = np.argsort(p.rank_cost, kind="stable")[: len(items)]
        fits = p.rank_tokens[ranks] + p.item_len[items] <= p.cap
        p.move(items[fits], ranks[fits])
        for i in items[~fits].tolist():  # its rank is full: the cheapest with room, if any
            room = p.rank_tokens + p.item_len[i] <= p.cap
            if room.any():
                p.move_one(i, int(np.argmin(np.where(room, p.rank_cost, np.inf))))


def _move_in_pairs(p: _Placement, bound: float) -> bool:
    """One vectorized pass over many ranks at once: the k-th most expensive rank above the
    bound is paired with the k-th cheapest, and each pair makes the one move of an item that
    best halves its gap (a pair of ranks at a time, as _improve does, costs ~50 us each: at
    dp=1024 hundreds of ranks sit just above the bound). False if nothing moved."""
    by_cost = np.argsort(p.rank_cost, kind="stable")
    over = by_cost[::-1][: np.count_nonzero(p.rank_cost > bound * (1 + _GOOD_ENOUGH))]
    over = over[: len(p.rank_cost) // 2]
    if not len(over):
        return False
    under = by_cost[: len(over)]
    pair_of = np.full(len(p.rank_cost), -1, dtype=np.int64)
    pair_of[over] = np.arange(len(over))
    placed = np.flatnonzero(p.item_rank >= 0)
    mine = placed[pair_of[p.item_rank[placed]] >= 0]
    pair = pair_of[p.item_rank[mine]]
    gap = p.rank_cost[over] - p.rank_cost[under]
    c = p.item_cost[mine]
    ok = (c > 0) & (c < gap[pair]) & (p.rank_tokens[under[pair]] + p.item_len[mine] <= p.cap)
    mine, pair, score = mine[ok], pair[ok], np.abs(c[ok] - gap[pair[ok]] / 2)
    if not len(mine):
        return False
    order = np.lexsort((score, pair))
    first = order[np.r_[True, pair[order][1:] != pair[order][:-1]]]  # the best item of each pair
    p.move(mine[first], under[pair[first]])
    return True


def _refine(p: _Placement, bound: float) -> None:
    if len(p.rank_cost) < 2:
        return
    for _ in range(_MAX_REFINE):
        paid = p.paid()
        hi, lo = int(np.argmax(paid)), int(np.argmin(paid))
        if paid[hi] <= bound * (1 + _GOOD_ENOUGH):
            return
        if not _improve(p, hi, lo, paid, False) and not _improve(p, hi, lo, paid, True):
            return


def _improve(p: _Placement, hi: int, lo: int, paid: Floats, pairs: bool) -> bool:
    """The move of one of hi's items to another rank, or its swap with an item there, that
    leaves the higher of the two ranks cheapest (padding counted), within the cap; False if
    none lowers hi without lifting the other rank to hi's cost. The other rank is any rank
    where that is at most _WIDE_CANDIDATES pairs to weigh (a few ranks of few items), else
    the cheapest. With `pairs` (where single moves are stuck, and only among few items) also
    two of hi's items at once, and two items of one of the _PAIR_RANKS cheapest ranks."""
    item_rank, rank_cost, rank_tokens, padding = p.item_rank, p.rank_cost, p.rank_tokens, p.padding
    xs = np.flatnonzero(item_rank == hi)
    wide = len(xs) * (len(item_rank) + len(rank_cost)) <= _WIDE_CANDIDATES
    if pairs and not wide:
        return False  # pairs are weighed only where a step has few items
    if wide:
        ys = np.flatnonzero((item_rank >= 0) & (item_rank != hi))
        partners = np.flatnonzero(np.arange(len(rank_cost)) != hi)
    else:
        ys, partners = np.flatnonzero(item_rank == lo), np.array([lo])
    # rows: one of hi's items, then (pairs) two of them; columns: an item to swap with (on its
    # rank), a move to each partner rank (nothing comes back), then (pairs) two items to swap with
    give = _singles(p, xs, 0)
    take = _singles(p, ys, len(partners))
    col_rank = np.concatenate([item_rank[ys], partners])
    if pairs:
        a, b = np.triu_indices(len(xs), 1)
        give = _joined(give, _bundles(p, xs[a], xs[b]))
        cheap = np.argsort(paid, kind="stable")[:_PAIR_RANKS]
        a, b = _same_rank_pairs(ys[np.isin(item_rank[ys], cheap)], item_rank)
        take = _joined(take, _bundles(p, a, b))
        col_rank = np.concatenate([col_rank, item_rank[a]])
    delta = give.cost[:, None] - take.cost[None, :]  # the cost that goes from hi to the other rank
    moved = give.length[:, None] - take.length[None, :]
    hi_tokens, other_tokens = rank_tokens[hi] - moved, rank_tokens[col_rank][None, :] + moved
    mine = rank_cost[hi] - delta + padding(hi_tokens)
    other = rank_cost[col_rank][None, :] + delta + padding(other_tokens)
    ok = (mine < paid[hi]) & (other < paid[hi]) & (other_tokens <= p.cap) & (hi_tokens <= p.cap)
    if not ok.any():
        return False
    i, j = divmod(int(np.argmin(np.where(ok, np.maximum(mine, other), np.inf))), len(col_rank))
    to = int(col_rank[j])
    for x in (int(give.first[i]), int(give.second[i])):
        if x >= 0:
            p.move_one(x, to)
    for y in (int(take.first[j]), int(take.second[j])):
        if y >= 0:
            p.move_one(y, hi)
    return True


class _Bundles(NamedTuple):
    """Items that move together, one or two (second -1), with their summed cost and length."""

    first: Ints
    second: Ints
    cost: Floats
    length: Ints


def _singles(p: _Placement, items: Ints, empty: int) -> _Bundles:
    """Each item alone, then `empty` bundles of none (a move to a rank takes nothing back)."""
    none = np.full(len(items) + empty, -1)
    first = np.concatenate([items, none[:empty]])
    cost = np.concatenate([p.item_cost[items], np.zeros(empty)])
    return _Bundles(first, none, cost, np.concatenate([p.item_len[items], np.zeros(empty, dtype=np.int64)]))


def _bundles(p: _Placement, first: Ints, second: Ints) -> _Bundles:
    """Two items each."""
    return _Bundles(first, second, p.item_cost[first] + p.item_cost[second], p.item_len[first] + p.item_len[second])


def _joined(a: _Bundles, b: _Bundles) -> _Bundles:
    return _Bundles(*(np.concatenate([x, y]) for x, y in zip(a, b)))


def _same_rank_pairs(ys: Ints, item_rank: Ints) -> tuple[Ints, Ints]:
    """Every two of `ys` that sit on one rank."""
    a, b = np.triu_indices(len(ys), 1)
    same = item_rank[ys[a]] == item_rank[ys[b]]
    return ys[a[same]], ys[b[same]]


def padding_cost(cost_fn: CostFn, pad_to: int) -> float:
    """What one pad token costs a rank: a run of `pad_to` of them priced as a segment, per token."""
    one = np.ones(1, dtype=np.int64)
    return float(cost_fn(one * pad_to, one * 0, one * 0)[0]) / pad_to


def padded_length(tokens: int, pad_to: int, cap: int) -> int:
    """A rank's sequence length: its tokens rounded up to a multiple of `pad_to` (one multiple
    when it has none, so every rank gets a batch), never past `cap`."""
    return min(max(1, -(-tokens // pad_to)) * pad_to, cap)
