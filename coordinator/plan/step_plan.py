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
from typing import Any

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
    lengths, costs, groups = _measure(segments, cost_fn)
    may_wait = np.fromiter((s.delay < window for s in segments), bool, len(segments)) if window else None
    placed = assign(lengths, costs, len(carry), dp, rows, seq_len, groups, may_wait)
    bins, left = _distribute(segments, costs, placed.rank, placed.row, placed.cost, rows, window, doc_cap)
    return StepPlan(bins, left, _figures(placed.figures(costs), placed.cost, segments, left))


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
    lengths, costs, groups = _measure(segments, cost_fn)
    placed = assign_budgets(lengths, costs, len(carry), dp, cap, groups)
    rows = np.zeros(len(segments), dtype=np.int64)
    bins, left = _distribute(segments, costs, placed.rank, rows, placed.cost, 1, window, doc_cap)
    return StepPlan(bins, left, _figures(placed.figures(costs, groups), placed.cost, segments, left))


def _measure(segments: Sequence[Segment], cost_fn: CostFn) -> tuple[Ints, Floats, list[Ints]]:
    """Lengths, costs, and the groups of chunks that must share a rank (long_docs=bucket)."""
    lengths = np.array([s.length for s in segments], dtype=np.int64)
    sources = np.array([s.source for s in segments], dtype=np.int64)
    images = np.fromiter((s.image_count for s in segments), np.int64, len(segments))
    costs = cost_fn(lengths, sources, images) if segments else np.zeros(0)
    groups: dict[int, list[int]] = {}
    for i, segment in enumerate(segments):
        if segment.group >= 0:
            groups.setdefault(segment.group, []).append(i)
    return lengths, costs, [np.array(g) for g in groups.values()]


def _distribute(
    segments: Sequence[Segment],
    costs: Floats,
    rank_of: Ints,
    row_of: Ints,
    rank_cost: Floats,
    rows: int,
    window: int,
    doc_cap: int,
) -> tuple[list[list[list[Segment]]], list[Segment]]:
    """Each rank's rows of segments, in the step's order, and what is carried; a chunk that
    would take its document past `doc_cap` tokens of its rank is carried (and its rank's cost
    lowered), unless it has waited `window` steps."""
    bins: list[list[list[Segment]]] = [[[] for _ in range(rows)] for _ in range(len(rank_cost))]
    left = []
    held: dict[tuple[int, DocKey], int] = {}  # (rank, document) -> its tokens on that rank
    for i, (segment, rank, row) in enumerate(zip(segments, rank_of.tolist(), row_of.tolist())):
        if rank >= 0 and doc_cap and segment.group < 0 and not (window and segment.delay >= window):
            key = (rank, doc_key(segment))
            tokens = held.get(key, 0)
            if tokens and tokens + segment.length > doc_cap:
                rank_of[i], rank_cost[rank] = -1, rank_cost[rank] - costs[i]
                rank = -1
            else:
                held[key] = tokens + segment.length
        if rank >= 0:
            bins[rank][row].append(segment)
        else:
            left.append(dataclasses.replace(segment, delay=segment.delay + 1))
    return bins, left


def _figures(
    placed: dict[str, float], rank_cost: Floats, segments: Sequence[Segment], left: list[Segment]
) -> dict[str, Any]:
    return {
        **placed,
        "rank_cost": rank_cost.tolist(),
        "carried": len(left),
        "max_delay": max((s.delay for s in segments), default=0),
    }
