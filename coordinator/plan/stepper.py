"""Assemble each global step: draw segments by the mixture, plan, build every rank's arrays.

The only waiting here is for a source's next record; every decision is made by the pure
functions in schedule.py, mixture.py, spread.py and step_plan.py, so the steps are a function of spec,
seed, files and the recorded live mixture changes.

The stepper is sans-I/O in how it waits: a step is a generator (`step_requests`) that yields
requests, a float (wait that many seconds for records; 0: let others run) or a `Compute`
(a pure function to evaluate, such as balancing and building the step), and is sent back the
result. `next_step` drives it on the calling thread, sleeping and computing in place (replay,
trace, tests); the coordinator drives it on its event loop (coordinator/plan_task.py), where
it awaits instead of sleeping and moves a costly `Compute` to a thread.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from numpy.typing import NDArray

from omniload.coordinator.plan.budgets import padded_length
from omniload.coordinator.plan.cost import cost_function
from omniload.coordinator.plan.diversity import step_diversity
from omniload.coordinator.plan.documents import DocumentSource
from omniload.coordinator.plan.mixture import StrideQueue, advance, join
from omniload.coordinator.plan.packer import DocKey, Segment, doc_key
from omniload.coordinator.plan.requests import Compute, Requests, drive
from omniload.coordinator.plan.schedule import in_force, weights_at
from omniload.coordinator.plan.source_spreads import SourceSpreads
from omniload.coordinator.plan.spread import MemoryStore, Spread, UnitStore
from omniload.coordinator.plan.step_plan import StepPlan, plan_budgets, plan_step
from omniload.spec import Spec
from omniload.state import Carried, LoaderState, SpreadPosition

_BREATHE_S = 0.002  # the longest a step computes between two chances for others to run
_BREATHE_EVERY = 16  # calls of _breath_due between two readings of the clock


@dataclass(frozen=True, slots=True)
class Step:
    number: int  # 0-based
    batches: list[dict[str, NDArray[Any]]]  # one per data-parallel rank, as on the wire (omniload.batch_arrays)
    tokens: list[int]  # real (non-padding) tokens per data-parallel rank
    balance: dict[str, Any]  # the step plan's balance, with the step's diversity and drops
    weights: list[float]


@dataclass(slots=True)
class _Restoring:
    """What load_state_dict read and the first step (or rehydrate) rebuilds from."""

    carry: tuple[Carried, ...]
    spreads: dict[int, SpreadPosition]  # source -> the position of its spread
    resume_at: dict[int, tuple[int, int]]  # source -> its cursor in the checkpoint


def _carried(s: Segment) -> Carried:
    return Carried(s.source, s.sample_id, s.length, s.position_start, s.group, s.delay, *s.origin)


class Stepper:
    def __init__(
        self,
        spec: Spec,
        intakes: Sequence[DocumentSource],
        live_changes: list[tuple[int, dict[str, float]]] | None = None,
        store: UnitStore | None = None,
    ) -> None:
        """`store`: where the spreads' waiting documents are kept (the coordinator's is on disk,
        coordinator/spill.py; by default this process's memory)."""
        self._spec = spec
        self.dp = 0  # data-parallel size: known once the first rank connects
        self._names = [s.name for s in spec.sources]
        self._base_weights = spec.weights()
        self._cost = cost_function(spec.balance, spec.cost_coeffs, self._names)
        self._rank_cap = int(spec.max_doc_share * spec.rows * spec.seq_len)  # one document's tokens on a rank
        self._image_hw = spec.image_hw if spec.has_images else None
        self._plain = not spec.has_images and spec.long_docs != "bucket"  # no segment has images or a group
        self._masked = spec.masks_labels
        self.live_changes = live_changes if live_changes is not None else []
        self.passes = [0.0] * len(intakes)
        self.weights = [0.0] * len(intakes)  # those of the last step planned
        self.tokens_drawn = 0
        self.dropped = 0
        self.carry: list[Segment] = []
        store = store if store is not None else MemoryStore()
        self._sources = [
            SourceSpreads(spec, intake, store, self._horizon_of(i), self._breath_due, self._count_drop)
            for i, intake in enumerate(intakes)
        ]
        self.step = 0
        self.cancel = threading.Event()  # set from another thread to end a wait for records
        self._breathed, self._calls = time.monotonic(), 0
        self._saved: _Restoring | None = None  # set by load_state_dict until the carry and spreads are rebuilt

    def state_dict(self, fingerprint: str) -> dict[str, Any]:
        """The position after the last step planned (omniload.state's LoaderState, as JSON)."""
        return LoaderState(
            fingerprint,
            self.step,
            {source.name: source.cursor for source in self._sources},
            {source.name: source.position() for source in self._sources},
            tuple(self.passes),
            tuple(self.weights),
            self.tokens_drawn,
            self.dropped,
            tuple(_carried(s) for s in self.carry),
            tuple((at, weights) for at, weights in in_force(self.live_changes, self.step)),
        ).to_json()

    @property
    def next_spreads(self) -> list[Spread | None]:
        """Each source's next epoch's spread, read ahead (None where none is)."""
        return [source.next_spread for source in self._sources]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position. Each source's intake is moved back to the earliest of its
        spread's start and its carried documents; the first step re-reads from there to the
        saved cursor to rebuild the spread and the carry."""
        typed = LoaderState.from_json(state, "the loader position to restore")
        self.step, self.tokens_drawn, self.dropped = typed.step, typed.tokens, typed.dropped
        self.passes, self.weights = list(typed.passes), list(typed.weights)
        self.live_changes[:] = list(typed.live)
        self.carry = []
        saved = self._saved = _Restoring(typed.carry, {}, {})
        for index, source in enumerate(self._sources):
            cursor = typed.cursors[source.name]
            starts = [c.origin for c in saved.carry if c.source == index]
            if (position := typed.spreads[source.name]) is not None:
                saved.spreads[index] = position
                starts.append(position.start)
            source.seek(min([cursor, *starts]))
            saved.resume_at[index] = cursor

    def rehydrate(self) -> None:
        """Rebuild the carried segments and the spreads by re-reading their documents; the
        first step does it too. Until then state_dict does not hold the restored position."""
        drive(self._rehydrate(), self.cancel)

    def _rehydrate(self) -> Requests:
        if self._saved is None:
            return
        saved = self._saved
        wanted = {(c.source, *c.origin) for c in saved.carry}
        chunks: dict[int, Segment] = {}  # sample_id -> segment, of the carried documents
        for index, source in enumerate(self._sources):
            units = yield from source.rehydrate(saved.spreads.get(index), saved.resume_at[index], wanted)
            chunks.update((s.sample_id, s) for unit in units for s in unit)
        self.carry = [dataclasses.replace(chunks[c.sample_id], delay=c.delay) for c in saved.carry]
        self._saved = None

    def upcoming_weights(self) -> list[float]:
        """The weights the next step will draw with (schedule, then live changes)."""
        return weights_at(
            self._spec.mixture, self._base_weights, self._names, self.step, self.tokens_drawn, self.live_changes
        )

    def change_weights(self, weights: dict[str, float]) -> int:
        """Set the weights of the named sources from the next step on (the others keep theirs);
        returns that step. Call between steps: the change is recorded at that step boundary."""
        current = dict(zip(self._names, self.upcoming_weights()))
        self.live_changes.append((self.step, {**current, **weights}))
        return self.step

    def next_step(self, build: bool = True) -> Step | None:
        """The next step, or None when the data (or --steps) has ended; waits on this thread.
        With build=False the rank arrays are not made (a replay needs only the position)."""
        step: Step | None = drive(self.step_requests(build), self.cancel)
        return step

    def step_requests(self, build: bool = True) -> Requests:
        """The next step as requests (see the module's doc); returns the Step, or None.

        The mixture picks a source for each unit (a segment), so every step's token shares
        track the weights within about one segment; the unit comes from that source's shuffle
        window, within the per-document cap of the step."""
        yield from self._rehydrate()
        spec = self._spec
        if spec.steps and self.step >= spec.steps:
            return None
        weights = self.upcoming_weights()
        join(self.passes, self.weights, weights)
        self.weights = weights
        need = self.dp * spec.rows * spec.seq_len - sum(s.length for s in self.carry)
        in_step: dict[DocKey, int] = {}
        for segment in self.carry:
            in_step[doc_key(segment)] = in_step.get(doc_key(segment), 0) + segment.length
            if weights[segment.source] > 0:  # the mixture counts what a step delivers (see below)
                advance(self.passes, segment.source, segment.length, weights)
        fresh: list[Segment] = []
        queue = StrideQueue(self.passes, weights, [source.live for source in self._sources])
        cap = self._rank_cap * self.dp
        while need > 0:
            source = queue.peek()
            if source is None:
                break
            reading = self._sources[source]
            spread = reading.spread
            if spread is None or not spread.ready():  # (most draws need no generator: a unit is due)
                spread = yield from reading.ready()
                if spread is None:
                    queue.drop()
                    continue
            unit = spread.draw(in_step, cap, give_way=False)
            if unit is None:  # every unit due is over its document's cap: read on for others
                unit = yield from reading.draw_reading_on(spread, in_step, cap)
            tokens = unit[0].length if len(unit) == 1 else sum(s.length for s in unit)
            if spread.ended:
                yield from reading.read_next_epoch(spread, tokens)
            queue.advance(tokens)
            self.tokens_drawn += tokens
            key = doc_key(unit[0])
            in_step[key] = in_step.get(key, 0) + tokens
            fresh.extend(unit)
            need -= tokens
            if self._breath_due():  # a step at dp=1024 draws thousands of units
                yield 0.0
        if not fresh and not self.carry:
            return None
        carry, dp, image_hw, masked = list(self.carry), self.dp, self._image_hw, self._masked

        def balance_and_build() -> tuple[
            StepPlan, list[dict[str, NDArray[Any]]]
        ]:  # pure: the costly part of a step at a large dp
            if spec.rank_tokens == "variable":
                cap = spec.rank_token_cap
                plan = plan_budgets(
                    carry, fresh, dp, cap, self._cost, spec.balance_window, self._rank_cap, self._plain, spec.pad_to
                )
                widths = [padded_length(n, spec.pad_to, cap) for n in plan.tokens]
            else:
                plan = plan_step(
                    carry,
                    fresh,
                    dp,
                    spec.rows,
                    spec.seq_len,
                    self._cost,
                    spec.balance_window,
                    self._rank_cap,
                    self._plain,
                )
                widths = [spec.seq_len] * dp
            return plan, plan.batches(widths, image_hw, masked) if build else []

        plan, batches = yield Compute(balance_and_build)
        documents, top_shares = step_diversity(batches, len(self._sources))
        self.carry = plan.carry
        for segment in self.carry:  # not delivered: the next step counts it, and draws around it
            if weights[segment.source] > 0:
                advance(self.passes, segment.source, -segment.length, weights)
        step = Step(
            self.step,
            batches,
            plan.tokens,
            {**plan.balance, "dropped": self.dropped, "documents": documents, "top_doc_share": top_shares},
            weights,
        )
        self.step += 1
        self.live_changes[:] = in_force(self.live_changes, self.step)  # what replay needs, no history
        return step

    def _horizon_of(self, source: int) -> Callable[[], tuple[int, int]]:
        """A new spread's horizon and fill for `source`: its share of the job's, at the weights now."""

        def horizon() -> tuple[int, int]:
            share = self.weights[source] / (sum(self.weights) or 1.0)
            return self._spec.shuffle_horizon(self.dp, share)

        return horizon

    def _count_drop(self) -> None:
        self.dropped += 1

    def _breath_due(self) -> bool:
        """Whether to let others run now: every _BREATHE_S of work (a restore re-reads a spread
        of millions of tokens: the ranks' sessions must not wait for that). The clock
        is read every _BREATHE_EVERY calls, one a unit drawn or a document taken: a few us
        apart, tens for a long document's chunks or a sample's images, so 16 stay well under
        _BREATHE_S."""
        self._calls += 1
        if self._calls % _BREATHE_EVERY:
            return False
        now = time.monotonic()
        if now - self._breathed > _BREATHE_S:
            self._breathed = now
            return True
        return False
