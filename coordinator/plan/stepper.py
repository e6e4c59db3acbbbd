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
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from numpy.typing import NDArray

from omniload.coordinator.plan.budgets import padded_length
from omniload.coordinator.plan.cost import cost_function
from omniload.coordinator.plan.diversity import step_diversity
from omniload.coordinator.plan.documents import Doc, DocumentSource
from omniload.coordinator.plan.mixture import StrideQueue, advance, join
from omniload.coordinator.plan.packer import DocKey, Segment, doc_key
from omniload.coordinator.plan.schedule import in_force, weights_at
from omniload.coordinator.plan.spread import MemoryStore, Spread, UnitStore
from omniload.coordinator.plan.step_plan import StepPlan, plan_budgets, plan_step
from omniload.coordinator.plan.units import Unit, units_of
from omniload.errors import SourceFailed
from omniload.spec import Spec
from omniload.state import Carried, LoaderState, SpreadPosition

_POLL_MIN_S, _POLL_MAX_S = 200e-6, 10e-3
_CAP_READS = 64  # documents read on, at most, to find a unit under its document's cap
_BREATHE_S = 0.002  # the longest a step computes between two chances for others to run
_BREATHE_EVERY = 16  # calls of _breath_due between two readings of the clock


class Cancelled(Exception):
    """The stepper was cancelled while it waited for a record (the job is stopping)."""


@dataclass(frozen=True, slots=True)
class Compute:
    """A request of a step: evaluate `fn()` (pure: it touches no stepper state) and send back the result."""

    fn: Callable[[], Any]


Requests = Generator[float | Compute, Any, Any]  # what a step yields, is sent, and returns


def drive(requests: Requests, cancel: threading.Event) -> Any:
    """Run a step's requests on this thread: sleep where it waits, compute in place."""
    try:
        request = next(requests)
        while True:
            if isinstance(request, Compute):
                request = requests.send(request.fn())
                continue
            if cancel.wait(request) if request else cancel.is_set():
                raise Cancelled()
            request = requests.send(None)
    except StopIteration as done:
        return done.value


@dataclass(frozen=True, slots=True)
class Step:
    number: int  # 0-based
    batches: list[dict[str, NDArray[Any]]]  # one per data-parallel rank, as on the wire (omniload.batch_arrays)
    tokens: list[int]  # real (non-padding) tokens per data-parallel rank
    figures: dict[str, Any]  # the planner's: rank costs, max/mean, lower bound, carried
    weights: list[float]


@dataclass(slots=True)
class _Restoring:
    """What restore read and the first step (or rehydrate) rebuilds from."""

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
        self._intakes = intakes
        self.dp = 0  # data-parallel size: known once the first rank connects
        self._names = [s.name for s in spec.sources]
        self._base_weights = spec.weights()
        self._cost = cost_function(spec.balance, spec.cost_coeffs, self._names)
        self._bucket_rows = spec.rows if spec.long_docs == "bucket" else 0
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
        self._store = store if store is not None else MemoryStore()
        self.spreads: list[Spread | None] = [None] * len(intakes)  # None: the next epoch's starts at the cursor
        # The next epoch's spread, read while the current one, its epoch all read, is drawn
        # empty (a token read for each drawn), so that its fill is ready when it is needed.
        self.next_spreads: list[Spread | None] = [None] * len(intakes)
        # Right after the last document taken: where the next spread starts and what a
        # checkpoint says (a SKIP record past it included or not, as the intake's cursor may be).
        self._next: list[tuple[int, int]] = [i.cursor for i in intakes]
        self.step = 0
        self.cancel = threading.Event()  # set from another thread to end a wait for records
        self._breathed, self._calls = time.monotonic(), 0
        self._saved: _Restoring | None = None  # set by restore until the carry and spreads are rebuilt

    def export_state(self, fingerprint: str) -> dict[str, Any]:
        """The position after the last step planned (omniload.state's LoaderState, as JSON)."""
        return LoaderState(
            fingerprint,
            self.step,
            {i.catalog.name: self._next[i.catalog.index] for i in self._intakes},
            {i.catalog.name: self._spread_position(i.catalog.index) for i in self._intakes},
            tuple(self.passes),
            tuple(self.weights),
            self.tokens_drawn,
            self.dropped,
            tuple(_carried(s) for s in self.carry),
            tuple((at, weights) for at, weights in in_force(self.live_changes, self.step)),
        ).to_json()

    def _spread_position(self, source: int) -> SpreadPosition | None:
        """The source's spread's position (where a restore reads from; the next epoch's spread,
        read ahead, follows from it); None when the next spread starts afresh at the cursor
        (none yet, or the last one used up its epoch and nothing of the next was read)."""
        spread, cursor = self.spreads[source], self._next[source]
        if spread is None or spread.exhausted:
            spread = self.next_spreads[source]
        if spread is None or (not spread.waiting_units and cursor[0] >= spread.epoch_end):
            return None
        return spread.position(cursor)

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a position. Each source's intake is moved back to the earliest of its
        spread's start and its carried documents; the first step re-reads from there to the
        saved cursor to rebuild the spread and the carry."""
        typed = LoaderState.from_json(state, "the loader position to restore")
        self.step, self.tokens_drawn, self.dropped = typed.step, typed.tokens, typed.dropped
        self.passes, self.weights = list(typed.passes), list(typed.weights)
        self.live_changes[:] = list(typed.live)
        self.carry, self.spreads = [], [None] * len(self._intakes)
        self.next_spreads = [None] * len(self._intakes)
        saved = self._saved = _Restoring(typed.carry, {}, {})
        for intake in self._intakes:
            index, name = intake.catalog.index, intake.catalog.name
            cursor = typed.cursors[name]
            starts = [c.origin for c in saved.carry if c.source == index]
            if (position := typed.spreads[name]) is not None:
                saved.spreads[index] = position
                starts.append(position.start)
            intake.seek(*min([cursor, *starts]))
            self._next[index] = intake.cursor
            saved.resume_at[index] = cursor

    def rehydrate(self) -> None:
        """Rebuild the carried segments and the spreads by re-reading their documents; the
        first step does it too. Until then export_state does not hold the restored position."""
        drive(self._rehydrate(), self.cancel)

    def _rehydrate(self) -> Requests:
        if self._saved is None:
            return
        saved = self._saved
        wanted = {(c.source, *c.origin) for c in saved.carry}
        chunks: dict[int, Segment] = {}  # sample_id -> segment, of the carried documents
        for intake in self._intakes:
            index = intake.catalog.index
            position = saved.spreads.get(index)
            spread = None
            if position is not None:
                spread = self.spreads[index] = self._new_spread(index, position.start[0], position)
            while intake.cursor < saved.resume_at[index]:
                if self._breath_due():
                    yield 0.0
                doc = self._take(intake, None) or (yield from self._await_doc(intake, None))
                if doc is None:
                    break
                if (doc.source, *doc.origin) in wanted:
                    chunks.update((s.sample_id, s) for unit in self._units(doc) or [] for s in unit)
                if spread is None or position is None or doc.origin < position.start:
                    continue
                if doc.group < spread.epoch_end:
                    self._add(spread, doc, counting=False)
                else:  # the next epoch's, read ahead: every unit of it waits
                    self._add(self._next_spread(index, spread), doc, counting=False)
            if spread is not None and position is not None:
                spread.restored()
                if position.ended:  # as the saved one was: when it ended is when the read-ahead began
                    spread.end()
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
        live = [
            not (self._dry(i) and (s is None or s.exhausted) and self.next_spreads[i] is None)
            for i, s in enumerate(self.spreads)
        ]
        queue = StrideQueue(self.passes, weights, live)
        cap = self._rank_cap * self.dp
        while need > 0:
            source = queue.peek()
            if source is None:
                break
            spread = self.spreads[source]
            if spread is None or not spread.ready():  # (most draws need no generator: a unit is due)
                spread = yield from self._ready_spread(source)
                if spread is None:
                    queue.drop()
                    continue
            unit = spread.draw(in_step, cap, give_way=False)
            if unit is None:  # every unit due is over its document's cap: read on for others
                unit = yield from self._draw_reading_on(source, spread, in_step, cap)
            tokens = unit[0].length if len(unit) == 1 else sum(s.length for s in unit)
            if spread.ended:
                yield from self._read_next_epoch(source, spread, tokens)
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
        documents, top_shares = step_diversity(batches, len(self._intakes))
        self.carry = plan.carry
        for segment in self.carry:  # not delivered: the next step counts it, and draws around it
            if weights[segment.source] > 0:
                advance(self.passes, segment.source, -segment.length, weights)
        step = Step(
            self.step,
            batches,
            plan.tokens,
            {**plan.figures, "dropped": self.dropped, "documents": documents, "top_doc_share": top_shares},
            weights,
        )
        self.step += 1
        self.live_changes[:] = in_force(self.live_changes, self.step)  # what replay needs, no history
        return step

    def _ready_spread(self, source: int) -> Requests:
        """The source's spread once a unit of it is due: documents are taken until one is, or
        until its epoch has been read (then the next epoch's spread); None when the source has
        ended."""
        intake, spread = self._intakes[source], self.spreads[source]
        while True:
            if spread is None or spread.exhausted:
                if (upcoming := self.next_spreads[source]) is not None:  # read ahead: its fill is in
                    spread = self.spreads[source] = upcoming
                    self.next_spreads[source] = None
                    continue
                if self._dry(source):
                    return None
                spread = self.spreads[source] = self._new_spread(source, self._next_group(source))
            if spread.ready():
                return spread
            if self._breath_due():
                yield 0.0
            yield from self._read_into(intake, spread)

    def _draw_reading_on(self, source: int, spread: Spread, in_step: dict[DocKey, int], cap: int) -> Requests:
        """A unit within the cap found by taking up to _CAP_READS more documents (each makes
        units due); else the cap gives way."""
        intake = self._intakes[source]
        for _ in range(_CAP_READS):
            if spread.ended or not (yield from self._read_into(intake, spread)):
                break
            if (unit := spread.draw(in_step, cap, give_way=False)) is not None:
                return unit
        return spread.draw(in_step, cap)

    def _read_next_epoch(self, source: int, spread: Spread, tokens: int) -> Requests:
        """Read the next epoch's documents, a token for each drawn from the current spread since
        its epoch was read. It waits for a record that is not in its ring yet: what has been
        read is part of the position, so it must follow from the draws alone, never from
        which records happened to be there."""
        spread.drawn_since_end += tokens
        if self._dry(source):
            return
        upcoming = self._next_spread(source, spread)
        intake = self._intakes[source]
        while not upcoming.ended and upcoming.clock < spread.drawn_since_end:
            yield from self._read_into(intake, upcoming)

    def _read_into(self, intake: DocumentSource, spread: Spread) -> Requests:
        """Add the source's next document of the spread's epoch, waiting for its record; at the
        epoch's end (or the source's), end the spread. Returns whether a document was added.
        A spread never spans epochs; a document that is here (the most) costs no wait."""
        doc = self._take(intake, spread.epoch_end) or (yield from self._await_doc(intake, spread.epoch_end))
        if doc is None:
            spread.end()
            return False
        self._add(spread, doc)
        return True

    def _next_spread(self, source: int, spread: Spread) -> Spread:
        """The spread of the epoch after `spread`'s, made when first needed."""
        if (upcoming := self.next_spreads[source]) is None:
            upcoming = self.next_spreads[source] = self._new_spread(source, spread.epoch_end)
        return upcoming

    def _new_spread(self, source: int, group: int, position: SpreadPosition | None = None) -> Spread:
        """The spread of the epoch that holds `group`: its horizon the source's share of the
        job's, at the weights now (a restored spread keeps its own)."""
        share = self.weights[source] / (sum(self.weights) or 1.0)
        return Spread(
            source,
            self._spec.seed,
            *self._spec.shuffle_horizon(self.dp, share),
            self._store,
            self._spec.seq_len,
            self._intakes[source].epoch_end(group),
            2 / self._spec.max_doc_share,  # a very long document takes at most half its cap a step
            self._bucket_rows,
            self._spec.rows,
            self._image_hw,
            position,
        )

    def _next_group(self, source: int) -> int:
        """The group of the source's next document (its intake has skipped what cannot be read)."""
        return max(self._next[source][0], self._intakes[source].cursor[0])

    def _add(self, spread: Spread, doc: Doc, counting: bool = True) -> None:
        """Put a document's units in the spread (long_docs=drop drops a long one: `counting`)."""
        if self._spec.long_docs == "drop" and len(doc.tokens) > self._spec.seq_len:
            self.dropped += counting
            return
        try:
            spread.add(doc)
        except ValueError as exc:
            raise SourceFailed(self._names[doc.source], str(exc)) from None

    def _units(self, doc: Doc) -> list[Unit] | None:
        """The document's units; None when long_docs=drop drops it."""
        if self._spec.long_docs == "drop" and len(doc.tokens) > self._spec.seq_len:
            return None
        try:
            return units_of(doc, self._spec.seq_len, self._bucket_rows, self._spec.rows)
        except ValueError as exc:
            raise SourceFailed(self._names[doc.source], str(exc)) from None

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

    def _dry(self, source: int) -> bool:
        return self._intakes[source].dry

    def _take(self, intake: DocumentSource, until_group: int | None) -> Doc | None:
        """The source's next document if its record is in its ring, else None."""
        if (doc := intake.poll(until_group)) is None:
            return None
        self._next[intake.catalog.index] = doc.after
        return doc

    def _await_doc(self, intake: DocumentSource, until_group: int | None) -> Requests:
        """After _take found nothing: wait for the source's next record; None if the source
        ran dry or its cursor reached `until_group`."""
        delay, since = _POLL_MIN_S, time.monotonic()
        while True:
            if intake.dry or (until_group is not None and intake.group >= until_group):
                return None
            waited = time.monotonic() - since
            if waited > self._spec.worker_timeout:
                raise SourceFailed(
                    intake.catalog.name,
                    f"no sample arrived for {waited:.0f}s (worker timeout "
                    f"{self._spec.worker_timeout:.0f}s): is a transform stuck? "
                    "Raise --worker-timeout for very slow transforms",
                )
            yield delay
            delay = min(delay * 2, _POLL_MAX_S)
            if (doc := intake.poll(until_group)) is not None:
                self._next[intake.catalog.index] = doc.after
                return doc
