"""Plan one global step: every segment to a data-parallel rank and row; pure.

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

from omniload.coordinator.plan.balance import assign
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
    segments = [*carry, *fresh]
    lengths = np.array([s.length for s in segments], dtype=np.int64)
    sources = np.array([s.source for s in segments], dtype=np.int64)
    images = np.fromiter((s.image_count for s in segments), np.int64, len(segments))
    costs = cost_fn(lengths, sources, images) if segments else np.zeros(0)
    groups: dict[int, list[int]] = {}
    for i, segment in enumerate(segments):
        if segment.group >= 0:
            groups.setdefault(segment.group, []).append(i)
    may_wait = np.fromiter((s.delay < window for s in segments), bool, len(segments)) if window else None
    placed = assign(lengths, costs, len(carry), dp, rows, seq_len, [np.array(g) for g in groups.values()], may_wait)
    bins: list[list[list[Segment]]] = [[[] for _ in range(rows)] for _ in range(dp)]
    left = []
    held: dict[tuple[int, DocKey], int] = {}  # (rank, document) -> its tokens on that rank
    for i, (segment, rank, row) in enumerate(zip(segments, placed.rank.tolist(), placed.row.tolist())):
        if rank >= 0 and doc_cap and segment.group < 0 and not (window and segment.delay >= window):
            key = (rank, doc_key(segment))
            tokens = held.get(key, 0)
            if tokens and tokens + segment.length > doc_cap:
                placed.rank[i], placed.cost[rank] = -1, placed.cost[rank] - costs[i]
                rank = -1
            else:
                held[key] = tokens + segment.length
        if rank >= 0:
            bins[rank][row].append(segment)
        else:
            left.append(dataclasses.replace(segment, delay=segment.delay + 1))
    figures = {
        **placed.figures(costs),
        "rank_cost": placed.cost.tolist(),
        "carried": len(left),
        "max_delay": max((s.delay for s in segments), default=0),
    }
    return StepPlan(bins, left, figures)
