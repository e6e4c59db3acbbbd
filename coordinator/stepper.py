"""Assemble each global step: draw documents by the mixture, plan, build every rank's arrays.

The only waiting here is for a source's next record; every decision is made by the pure
functions in mixture.py and packer.py, so the steps are a function of spec, seed and files.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from omniload.errors import SourceFailed
from omniload.order import MAX_CHUNKS, sample_id
from omniload.spec import Spec

from omniload.coordinator.intake import Doc, SourceIntake
from omniload.coordinator.mixture import next_source
from omniload.coordinator.packer import Segment, build_batch, chunk_bounds, plan_step

_POLL_MIN_S, _POLL_MAX_S = 200e-6, 10e-3


@dataclass(frozen=True, slots=True)
class Step:
    number: int  # 0-based
    batches: list[dict[str, np.ndarray]]  # one per data-parallel rank
    tokens: list[int]  # real (non-padding) tokens per data-parallel rank


class Stepper:
    def __init__(self, spec: Spec, intakes: list[SourceIntake], dp: int) -> None:
        self._spec = spec
        self._intakes = intakes
        self._dp = dp
        self._weights = spec.weights()
        self.tokens_drawn = [0] * len(intakes)
        self.carry: list[Segment] = []
        self.step = 0

    async def next_step(self) -> Step | None:
        """The next step, or None when the data (or --steps) has ended."""
        spec = self._spec
        if spec.steps and self.step >= spec.steps:
            return None
        need = self._dp * spec.rows * spec.seq_len - sum(s.length for s in self.carry)
        fresh: list[Segment] = []
        while need > 0:
            source = next_source(self.tokens_drawn, self._weights, [not i.dry for i in self._intakes])
            if source is None:
                break
            doc = await self._next_doc(self._intakes[source])
            if doc is None:
                continue
            self.tokens_drawn[source] += len(doc.tokens)
            fresh.extend(segments_of(doc, spec.seq_len))
            need -= len(doc.tokens)
        if not fresh and not self.carry:
            return None
        plan = plan_step(self.carry, fresh, self._dp, spec.rows, spec.seq_len)
        self.carry = plan.carry
        step = Step(self.step, [build_batch(rows, spec.seq_len) for rows in plan.rows],
                    [sum(s.length for row in rows for s in row) for rows in plan.rows])
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


def segments_of(doc: Doc, seq_len: int) -> list[Segment]:
    bounds = chunk_bounds(len(doc.tokens), seq_len)
    if len(bounds) > MAX_CHUNKS:
        raise SourceFailed(str(doc.source), f"a document of {len(doc.tokens)} tokens makes more than "
                           f"{MAX_CHUNKS} chunks of --seq-len {seq_len}")
    return [Segment(doc.source, sample_id(doc.source, doc.ordinal, chunk), stop - start, doc.tokens[start:stop])
            for chunk, (start, stop) in enumerate(bounds)]
