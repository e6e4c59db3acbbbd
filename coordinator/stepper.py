"""Assemble each global step: draw documents by the mixture, plan, build every rank's arrays.

The only waiting here is for a source's next record; every decision is made by the pure
functions in schedule.py, mixture.py and planner.py, so the steps are a function of spec,
seed, files and the recorded live mixture changes.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from omniload.errors import SourceFailed
from omniload.order import MAX_CHUNKS, sample_id
from omniload.spec import Spec

from omniload.coordinator.cost import cost_function
from omniload.coordinator.intake import Doc, SourceIntake
from omniload.coordinator.mixture import advance, join, next_source
from omniload.coordinator.packer import Segment, build_batch, chunk_bounds
from omniload.coordinator.planner import plan_step
from omniload.coordinator.schedule import weights_at

_POLL_MIN_S, _POLL_MAX_S = 200e-6, 10e-3


@dataclass(frozen=True, slots=True)
class Step:
    number: int  # 0-based
    batches: list[dict[str, np.ndarray]]  # one per data-parallel rank
    tokens: list[int]  # real (non-padding) tokens per data-parallel rank
    figures: dict  # the planner's: rank costs, max/mean, lower bound, carried
    weights: list[float]


class Stepper:
    def __init__(self, spec: Spec, intakes: list[SourceIntake], dp: int,
                 live_changes: list[tuple[int, dict[str, float]]] | None = None) -> None:
        self._spec = spec
        self._intakes = intakes
        self._dp = dp
        self._names = [s.name for s in spec.sources]
        self._base_weights = spec.weights()
        self._cost = cost_function(spec.balance, spec.cost_coeffs, self._names)
        self.live_changes = live_changes if live_changes is not None else []
        self.passes = [0.0] * len(intakes)
        self.weights = [0.0] * len(intakes)  # those of the last step planned
        self.tokens_drawn = 0
        self.dropped = 0
        self.carry: list[Segment] = []
        self.step = 0

    async def next_step(self) -> Step | None:
        """The next step, or None when the data (or --steps) has ended."""
        spec = self._spec
        if spec.steps and self.step >= spec.steps:
            return None
        weights = weights_at(spec.mixture, self._base_weights, self._names, self.step, self.tokens_drawn,
                             self.live_changes)
        join(self.passes, self.weights, weights)
        self.weights = weights
        need = self._dp * spec.rows * spec.seq_len - sum(s.length for s in self.carry)
        fresh: list[Segment] = []
        while need > 0:
            source = next_source(self.passes, weights, [not i.dry for i in self._intakes])
            if source is None:
                break
            doc = await self._next_doc(self._intakes[source])
            if doc is None:
                continue
            if spec.long_docs == "drop" and len(doc.tokens) > spec.seq_len:
                self.dropped += 1
                continue
            advance(self.passes, source, len(doc.tokens), weights)
            self.tokens_drawn += len(doc.tokens)
            fresh.extend(segments_of(doc, spec.seq_len, bucket_rows=spec.rows if spec.long_docs == "bucket" else 0))
            need -= len(doc.tokens)
        if not fresh and not self.carry:
            return None
        plan = plan_step(self.carry, fresh, self._dp, spec.rows, spec.seq_len, self._cost, spec.balance_window)
        self.carry = plan.carry
        step = Step(self.step, [build_batch(rows, spec.seq_len) for rows in plan.rows],
                    [sum(s.length for row in rows for s in row) for rows in plan.rows],
                    {**plan.figures, "dropped": self.dropped}, weights)
        self.step += 1
        return step

    async def _next_doc(self, intake: SourceIntake) -> Doc | None:
        """Wait for the source's next document; None if the source ran dry."""
        delay, since = _POLL_MIN_S, time.monotonic()
        while (doc := intake.poll()) is None:
            if intake.dry:
                return None
            waited = time.monotonic() - since
            if waited > self._spec.worker_timeout:
                raise SourceFailed(intake.catalog.name, f"no sample arrived for {waited:.0f}s (worker timeout "
                                   f"{self._spec.worker_timeout:.0f}s): is a transform stuck? "
                                   "Raise --worker-timeout for very slow transforms")
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        return doc


def segments_of(doc: Doc, seq_len: int, bucket_rows: int = 0) -> list[Segment]:
    """A document's row-sized chunks. With bucket_rows, chunks of a long document stay together
    in groups of up to that many whole rows of one rank, positions running on within a group."""
    bounds = chunk_bounds(len(doc.tokens), seq_len)
    if len(bounds) > MAX_CHUNKS:
        raise SourceFailed(str(doc.source), f"a document of {len(doc.tokens)} tokens makes more than "
                           f"{MAX_CHUNKS} chunks of --seq-len {seq_len}")
    ids = [sample_id(doc.source, doc.ordinal, chunk) for chunk in range(len(bounds))]
    if not bucket_rows or len(bounds) < 2:
        return [Segment(doc.source, i, stop - start, doc.tokens[start:stop]) for i, (start, stop) in zip(ids, bounds)]
    return [Segment(doc.source, i, stop - start, doc.tokens[start:stop],
                    position_start=(chunk % bucket_rows) * seq_len, group=ids[chunk - chunk % bucket_rows])
            for chunk, (i, (start, stop)) in enumerate(zip(ids, bounds))]
