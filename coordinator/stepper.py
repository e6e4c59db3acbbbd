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
from omniload.state import STATE_VERSION

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
    def __init__(self, spec: Spec, intakes: list[SourceIntake],
                 live_changes: list[tuple[int, dict[str, float]]] | None = None) -> None:
        self._spec = spec
        self._intakes = intakes
        self.dp = 0  # data-parallel size: known once the first rank connects
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
        self._saved_carry: list[tuple] | None = None  # set by restore until the carry is rebuilt
        self._resume_at: dict[int, tuple[int, int]] = {}

    def export_state(self, fingerprint: str) -> dict:
        """The position after the last step planned (see omniload.state for the keys)."""
        return {
            "version": STATE_VERSION, "fingerprint": fingerprint, "step": self.step,
            "cursors": {i.catalog.name: list(i.cursor) for i in self._intakes},
            "passes": list(self.passes), "weights": list(self.weights), "tokens": self.tokens_drawn,
            "dropped": self.dropped,
            "carry": [[s.source, s.sample_id, s.length, s.position_start, s.group, s.delay, *s.origin]
                      for s in self.carry],
            "live": [[at, weights] for at, weights in self.live_changes],
        }

    def restore(self, state: dict) -> None:
        """Continue from a position. Each source's intake is moved back to its earliest carried
        document; the first step re-reads from there to the saved cursor to rebuild the carry."""
        self.step, self.tokens_drawn, self.dropped = state["step"], state["tokens"], state["dropped"]
        self.passes, self.weights = list(state["passes"]), list(state["weights"])
        self.live_changes[:] = [(at, weights) for at, weights in state["live"]]
        self._saved_carry = [tuple(entry) for entry in state["carry"]]
        self._resume_at = {}
        for intake in self._intakes:
            cursor = tuple(state["cursors"][intake.catalog.name])
            origins = [(e[6], e[7]) for e in self._saved_carry if e[0] == intake.catalog.index]
            intake.seek(*min([cursor, *origins]))
            self._resume_at[intake.catalog.index] = cursor

    async def _rehydrate(self) -> None:
        """Rebuild the carried segments by re-reading their documents (see restore)."""
        wanted = {(e[0], e[6], e[7]) for e in self._saved_carry}
        tokens = {}
        for intake in self._intakes:
            while intake.cursor < self._resume_at[intake.catalog.index]:
                doc = await self._next_doc(intake)
                if doc is None:
                    break
                if (doc.source, doc.g, doc.row) in wanted:
                    tokens[(doc.source, doc.g, doc.row)] = doc.tokens
        seq_len = self._spec.seq_len
        self.carry = []
        for source, sid, length, position_start, group, delay, g, row in self._saved_carry:
            start = (sid & (MAX_CHUNKS - 1)) * seq_len
            self.carry.append(Segment(source, sid, length, tokens[(source, g, row)][start : start + length],
                                      position_start, group, delay, (g, row)))
        self._saved_carry = None

    def upcoming_weights(self) -> list[float]:
        """The weights the next step will draw with (schedule, then live changes)."""
        return weights_at(self._spec.mixture, self._base_weights, self._names, self.step, self.tokens_drawn,
                          self.live_changes)

    async def next_step(self) -> Step | None:
        """The next step, or None when the data (or --steps) has ended."""
        if self._saved_carry is not None:
            await self._rehydrate()
        spec = self._spec
        if spec.steps and self.step >= spec.steps:
            return None
        weights = self.upcoming_weights()
        join(self.passes, self.weights, weights)
        self.weights = weights
        need = self.dp * spec.rows * spec.seq_len - sum(s.length for s in self.carry)
        fresh: list[Segment] = []
        live = [not i.dry for i in self._intakes]
        while need > 0:
            source = next_source(self.passes, weights, live)
            if source is None:
                break
            doc = await self._next_doc(self._intakes[source])
            if doc is None:
                live[source] = False
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
        plan = plan_step(self.carry, fresh, self.dp, spec.rows, spec.seq_len, self._cost, spec.balance_window)
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
    origin = (doc.g, doc.row)
    if not bucket_rows or len(bounds) < 2:
        return [Segment(doc.source, i, stop - start, doc.tokens[start:stop], origin=origin)
                for i, (start, stop) in zip(ids, bounds)]
    return [Segment(doc.source, i, stop - start, doc.tokens[start:stop], origin=origin,
                    position_start=(chunk % bucket_rows) * seq_len, group=ids[chunk - chunk % bucket_rows])
            for chunk, (i, (start, stop)) in enumerate(zip(ids, bounds))]
