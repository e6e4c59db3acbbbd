"""Plan one global step: every segment to a data-parallel rank and row; pure.

--rank-tokens fixed (plan_step) gives every rank rows of seq_len tokens (balance.py);
--rank-tokens variable (plan_budgets) gives each rank one row of its own length (budgets.py).

Which segments are in the step is already decided (the mixture); this regroups them by
cost (balance.py) and returns each rank's rows, what waits for the next step, and the
step's figures: each rank's cost, max/mean, and the lower bound. A document may hold at most
`doc_cap` tokens of a rank (or one segment, if that is longer): a further chunk of it placed
on the same rank waits for the next step instead, unless it has waited --balance-window steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

import numpy as np

from omniload.coordinator.plan.balance import Floats, Ints, assign
from omniload.coordinator.plan.budgets import assign_budgets
from omniload.coordinator.plan.cost import CostFn
from omniload.coordinator.plan.packer import DocKey, Segment, doc_key


@dataclass(frozen=True, slots=True)
class StepPlan:
    rows: list[list[list[Segment]]]  # [dp rank][row] -> segments in order
    carry: list[Segment]  # chosen for this step but not placed; first in line next step
    figures: dict[str, Any]


def plan_step(
    carry: Sequence[Segment],
    fresh: Sequence[Segment],
    dp: int,
    rows: int,
    seq_len: int,
    cost_fn: CostFn,
    window: int = 0,
    doc_cap: int = 0,
) -> StepPlan:
    """--rank-tokens fixed: every rank `rows` rows of `seq_len` tokens."""
    segments = [*carry, *fresh]
    m = _measure(segments, cost_fn)
    may_wait = m.delay < window if window else None
    placed = assign(m.lengths, m.costs, len(carry), dp, rows, seq_len, m.groups, may_wait)
    bins, left = _distribute(segments, m, placed.rank, placed.row, placed.cost, rows, window, doc_cap)
    return StepPlan(bins, left, _figures(placed.figures(m.costs), placed.cost, m, left))


def plan_budgets(
    carry: Sequence[Segment],
    fresh: Sequence[Segment],
    dp: int,
    cap: int,
    cost_fn: CostFn,
    window: int = 0,
    doc_cap: int = 0,
) -> StepPlan:
    """--rank-tokens variable: every rank one row (a packed sequence) of at most `cap` tokens,
    as many as make the ranks' costs equal (budgets.py); the same carry-over and document cap."""
    segments = [*carry, *fresh]
    m = _measure(segments, cost_fn)
    placed = assign_budgets(m.lengths, m.costs, len(carry), dp, cap, m.groups)
    rows = np.zeros(len(segments), dtype=np.int64)
    bins, left = _distribute(segments, m, placed.rank, rows, placed.cost, 1, window, doc_cap)
    return StepPlan(bins, left, _figures(placed.figures(m.costs, m.groups), placed.cost, m, left))


class _Measured(NamedTuple):
    """What planning reads of a step's segments, one array each (a step at dp=1024 holds
    15,000+ segments: one pass over them per attribute, with attrgetter, costs ~1 ms)."""

    lengths: Ints
    costs: Floats
    source: Ints
    group_of: Ints  # the group of a document kept whole (long_docs=bucket), or -1
    delay: Ints
    groups: list[Ints]  # the segments of each such group


def _measure(segments: Sequence[Segment], cost_fn: CostFn) -> _Measured:
    n = len(segments)

    def column(name: str) -> Ints:
        return np.fromiter(map(attrgetter(name), segments), np.int64, n)

    lengths, source, group_of = column("length"), column("source"), column("group")
    costs = cost_fn(lengths, source, column("image_count")) if segments else np.zeros(0)
    groups: dict[int, list[int]] = {}
    for i in np.flatnonzero(group_of >= 0).tolist():
        groups.setdefault(int(group_of[i]), []).append(i)
    return _Measured(lengths, costs, source, group_of, column("delay"), [np.array(g) for g in groups.values()])


def _distribute(
    segments: Sequence[Segment],
    m: _Measured,
    rank_of: Ints,
    row_of: Ints,
    rank_cost: Floats,
    rows: int,
    window: int,
    doc_cap: int,
) -> tuple[list[list[list[Segment]]], list[Segment]]:
    """Each rank's rows of segments, in the step's order, and what is carried (_hold_back)."""
    if doc_cap:
        _hold_back(segments, m, rank_of, rank_cost, window, doc_cap)
    dp = len(rank_cost)
    slot = rank_of * rows + row_of  # (rank, row) as one number
    placed = np.flatnonzero(rank_of >= 0)
    order = placed[np.argsort(slot[placed], kind="stable")]  # by rank and row, in the step's order within
    bounds = np.searchsorted(slot[order], np.arange(dp * rows + 1)).tolist()
    in_order = [segments[i] for i in order.tolist()]
    bins = [[in_order[bounds[r * rows + w] : bounds[r * rows + w + 1]] for w in range(rows)] for r in range(dp)]
    left = [segments[i] for i in np.flatnonzero(rank_of < 0).tolist()]
    return bins, [dataclasses.replace(s, delay=s.delay + 1) for s in left]


def _hold_back(
    segments: Sequence[Segment], m: _Measured, rank_of: Ints, rank_cost: Floats, window: int, doc_cap: int
) -> None:
    """A chunk that would take its document past `doc_cap` tokens of its rank is carried (and
    its rank's cost lowered), in the step's order, unless it has waited `window` steps or is
    part of a document kept whole. Only a document with two chunks or more in the step can be
    over the cap, so only those are looked at one by one."""
    subject = (rank_of >= 0) & (m.group_of < 0)
    if window:
        subject &= m.delay < window
    index = np.flatnonzero(subject)
    origins = [segments[i].origin for i in index.tolist()]
    doc_group = np.fromiter(map(itemgetter(0), origins), np.int64, len(origins))
    doc_pos = np.fromiter(map(itemgetter(1), origins), np.int64, len(origins))
    source = m.source[index]
    by_doc = np.lexsort((doc_pos, doc_group, source))
    same = (np.diff(source[by_doc]) == 0) & (np.diff(doc_group[by_doc]) == 0) & (np.diff(doc_pos[by_doc]) == 0)
    shared = np.zeros(len(origins), dtype=bool)
    shared[by_doc[1:][same]] = shared[by_doc[:-1][same]] = True  # documents with two chunks or more
    held: dict[tuple[int, DocKey], int] = {}  # (rank, document) -> its tokens on that rank
    for i in index[shared].tolist():  # in the step's order
        segment, rank = segments[i], int(rank_of[i])
        key = (rank, doc_key(segment))
        tokens = held.get(key, 0)
        if tokens and tokens + segment.length > doc_cap:
            rank_of[i], rank_cost[rank] = -1, rank_cost[rank] - m.costs[i]
        else:
            held[key] = tokens + segment.length


def _figures(placed: dict[str, float], rank_cost: Floats, m: _Measured, left: list[Segment]) -> dict[str, Any]:
    return {
        **placed,
        "rank_cost": rank_cost.tolist(),
        "carried": len(left),
        "max_delay": int(m.delay.max(initial=0)),
    }
