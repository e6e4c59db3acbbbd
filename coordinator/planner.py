"""Plan one global step: every segment to a data-parallel rank and row; pure.

Which segments are in the step is already decided (the mixture); this regroups them by
cost (balance.py) and returns each rank's rows, what waits for the next step, and the
step's figures: each rank's cost, max/mean, and the lower bound.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniload.coordinator.balance import assign
from omniload.coordinator.cost import CostFn
from omniload.coordinator.packer import Segment


@dataclass(frozen=True, slots=True)
class StepPlan:
    rows: list[list[list[Segment]]]  # [dp rank][row] -> segments in order
    carry: list[Segment]  # chosen for this step but not placed; first in line next step
    figures: dict[str, Any]


def plan_step(carry: Sequence[Segment], fresh: Sequence[Segment], dp: int, rows: int, seq_len: int,
              cost_fn: CostFn, window: int = 0) -> StepPlan:
    segments = [*carry, *fresh]
    lengths = np.array([s.length for s in segments], dtype=np.int64)
    sources = np.array([s.source for s in segments], dtype=np.int64)
    costs = cost_fn(lengths, sources) if segments else np.zeros(0)
    groups: dict[int, list[int]] = {}
    for i, segment in enumerate(segments):
        if segment.group >= 0:
            groups.setdefault(segment.group, []).append(i)
    may_wait = np.fromiter((s.delay < window for s in segments), bool, len(segments)) if window else None
    placed = assign(lengths, costs, len(carry), dp, rows, seq_len,
                    [np.array(g) for g in groups.values()], may_wait)
    bins: list[list[list[Segment]]] = [[[] for _ in range(rows)] for _ in range(dp)]
    left = []
    for segment, rank, row in zip(segments, placed.rank.tolist(), placed.row.tolist()):
        if rank >= 0:
            bins[rank][row].append(segment)
        else:
            left.append(dataclasses.replace(segment, delay=segment.delay + 1))
    figures = {**placed.figures(costs), "rank_cost": placed.cost.tolist(), "carried": len(left),
               "max_delay": max((s.delay for s in segments), default=0)}
    return StepPlan(bins, left, figures)
