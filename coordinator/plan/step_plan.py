"""Plan one global step: every segment to a data-parallel rank and row; pure.

--rank-tokens fixed (plan_step) gives every rank rows of seq_len tokens (balance.py);
--rank-tokens variable (plan_budgets) gives each rank one row of its own length (budgets.py).

Which segments are in the step is already decided (the mixture); this regroups them by
cost (balance.py) and returns each rank's rows, what waits for the next step, and the
step's balance: each rank's cost, max/mean, and the lower bound. A document may hold at most
`doc_cap` tokens of a rank (or one segment, if that is longer): a further chunk of it placed
on the same rank waits for the next step instead, unless it has waited --balance-window steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from omniload.coordinator.plan.balance import Floats, Ints, assign
from omniload.coordinator.plan.budgets import assign_budgets, padding_cost
from omniload.coordinator.plan.cost import CostFn
from omniload.coordinator.plan.packer import DocKey, Segment, compact_batches, doc_key
from omniload.order import CHUNK_BITS


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Where each segment goes, as index arrays: the segments of rank r's row w are
    segments[order[bounds[r * rows + w] : bounds[r * rows + w + 1]]], in the step's order.
    Whoever reads them builds what it needs (batches: every rank's arrays; rank_rows: one
    rank's lists of segments), touching each segment once, with its tokens."""

    segments: list[Segment]
    order: Ints
    bounds: list[int]
    rows_per_rank: int
    tokens: list[int]  # per rank: real tokens placed
    carry: list[Segment]  # chosen for this step but not placed; first in line next step
    balance: dict[str, Any]  # rank costs, max/mean, the lower bound, what was carried

    def rank_rows(self, rank: int) -> list[list[Segment]]:
        """Rank `rank`'s rows: each a list of its segments in order."""
        first, pick = rank * self.rows_per_rank, self.segments.__getitem__
        return [
            list(map(pick, self.order[self.bounds[k] : self.bounds[k + 1]].tolist()))
            for k in range(first, first + self.rows_per_rank)
        ]

    def batches(
        self, widths: Sequence[int], image_hw: tuple[int, int] | None = None, masked: bool = False
    ) -> list[dict[str, NDArray[Any]]]:
        """Every rank's batch as it travels (packer.compact_batches), rank r's rows `widths[r]` long."""
        ordered = list(map(self.segments.__getitem__, self.order.tolist()))
        return compact_batches(ordered, self.bounds, self.rows_per_rank, widths, image_hw, masked)

    @property
    def rows(self) -> list[list[list[Segment]]]:
        """[rank][row] -> segments in order, every rank's (rank_rows)."""
        return [self.rank_rows(r) for r in range(len(self.tokens))]


def plan_step(
    carry: Sequence[Segment],
    fresh: Sequence[Segment],
    dp: int,
    rows: int,
    seq_len: int,
    cost_fn: CostFn,
    window: int = 0,
    doc_cap: int = 0,
    plain: bool = False,
) -> StepPlan:
    """--rank-tokens fixed: every rank `rows` rows of `seq_len` tokens. `plain`: no segment
    holds images or belongs to a group (a text job without long_docs=bucket), so neither is read."""
    segments = [*carry, *fresh]
    m = _measure(segments, len(carry), cost_fn, plain)
    may_wait = m.delay < window if window else None
    placed = assign(m.lengths, m.costs, len(carry), dp, rows, seq_len, m.groups, may_wait)
    plan = _distribute(segments, m, placed.rank, placed.row, placed.cost, rows, window, doc_cap)
    return dataclasses.replace(plan, balance=_balance(placed.balance(m.costs), placed.cost, m, plan.carry))


def plan_budgets(
    carry: Sequence[Segment],
    fresh: Sequence[Segment],
    dp: int,
    cap: int,
    cost_fn: CostFn,
    window: int = 0,
    doc_cap: int = 0,
    plain: bool = False,
    pad_to: int = 1,
) -> StepPlan:
    """--rank-tokens variable: every rank one row (a packed sequence) of at most `cap` tokens,
    as many as make the ranks' costs equal (budgets.py), padding to `pad_to` counted; the
    same carry-over and document cap."""
    segments = [*carry, *fresh]
    m = _measure(segments, len(carry), cost_fn, plain)
    pad_cost = padding_cost(cost_fn, pad_to) if pad_to > 1 else 0.0
    placed = assign_budgets(m.lengths, m.costs, len(carry), dp, cap, m.groups, pad_to, pad_cost)
    rows = np.zeros(len(segments), dtype=np.int64)
    plan = _distribute(segments, m, placed.rank, rows, placed.cost, 1, window, doc_cap)
    return dataclasses.replace(plan, balance=_balance(placed.balance(m.costs, m.groups), placed.cost, m, plan.carry))


class _Measured(NamedTuple):
    """What planning reads of a step's segments, one array each. A step at dp=1024 holds
    15,000+ segments and one pass over them per attribute costs ~0.5 ms, so only what a
    step can hold is read: delays only of carried segments (a fresh one has waited none),
    image counts and groups only where a segment can have them."""

    lengths: Ints
    costs: Floats
    source: Ints
    sample_id: Ints  # its document is sample_id >> CHUNK_BITS (order.sample_id)
    group_of: Ints  # the group of a document kept whole (long_docs=bucket), or -1
    delay: Ints
    groups: list[Ints]  # the segments of each such group


def _measure(segments: Sequence[Segment], carried: int, cost_fn: CostFn, plain: bool) -> _Measured:
    n = len(segments)

    def column(name: str, upto: int = n) -> Ints:
        return np.fromiter(map(attrgetter(name), segments[:upto] if upto < n else segments), np.int64, upto)

    lengths, source = column("length"), column("source")
    none = np.zeros(n, dtype=np.int64)
    group_of = none - 1 if plain else column("group")
    image_count = none if plain else column("image_count")
    costs = cost_fn(lengths, source, image_count) if segments else np.zeros(0)
    delay = np.zeros(n, dtype=np.int64)
    delay[:carried] = column("delay", carried)
    groups: dict[int, list[int]] = {}
    for i in np.flatnonzero(group_of >= 0).tolist():
        groups.setdefault(int(group_of[i]), []).append(i)
    return _Measured(
        lengths, costs, source, column("sample_id"), group_of, delay, [np.array(g) for g in groups.values()]
    )


def _distribute(
    segments: list[Segment],
    m: _Measured,
    rank_of: Ints,
    row_of: Ints,
    rank_cost: Floats,
    rows: int,
    window: int,
    doc_cap: int,
) -> StepPlan:
    """Each rank's rows of segments, in the step's order, and what is carried (_hold_back);
    the balance is the caller's."""
    if doc_cap:
        _hold_back(segments, m, rank_of, rank_cost, window, doc_cap)
    dp = len(rank_cost)
    slot = rank_of * rows + row_of  # (rank, row) as one number
    placed = np.flatnonzero(rank_of >= 0)
    key = slot[placed].astype(np.uint16) if dp * rows <= 1 << 16 else slot[placed]  # 16 bits: a radix sort, 10x
    order = placed[np.argsort(key, kind="stable")]  # by rank and row, in the step's order within
    bounds = np.searchsorted(slot[order], np.arange(dp * rows + 1)).tolist()
    tokens = np.bincount(rank_of[placed], m.lengths[placed], minlength=dp).astype(np.int64).tolist()
    left = [
        dataclasses.replace(s, delay=s.delay + 1)
        for s in map(segments.__getitem__, np.flatnonzero(rank_of < 0).tolist())
    ]
    return StepPlan(segments, order, bounds, rows, tokens, left, {})


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
    # chunks of one document share sample_id >> CHUNK_BITS (the converse need not hold: a
    # document read again in a later epoch has the same), so this finds a superset of the
    # documents with two chunks or more; doc_key below tells them apart exactly
    doc = m.sample_id[index] >> CHUNK_BITS
    by_doc = np.argsort(doc, kind="stable")
    same = np.diff(doc[by_doc]) == 0
    shared = np.zeros(len(index), dtype=bool)
    shared[by_doc[1:][same]] = shared[by_doc[:-1][same]] = True
    held: dict[tuple[int, DocKey], int] = {}  # (rank, document) -> its tokens on that rank
    for i in index[shared].tolist():  # in the step's order
        segment, rank = segments[i], int(rank_of[i])
        key = (rank, doc_key(segment))
        tokens = held.get(key, 0)
        if tokens and tokens + segment.length > doc_cap:
            rank_of[i], rank_cost[rank] = -1, rank_cost[rank] - m.costs[i]
        else:
            held[key] = tokens + segment.length


def _balance(placed: dict[str, float], rank_cost: Floats, m: _Measured, left: list[Segment]) -> dict[str, Any]:
    return {
        **placed,
        "rank_cost": rank_cost.tolist(),
        "carried": len(left),
        "max_delay": int(m.delay.max(initial=0)),
    }
