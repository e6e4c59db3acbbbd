"""One source's documents on their way to being drawn: its intake, the spread of the epoch
being drawn, the next epoch's spread read ahead, and the cursor right after the last document
taken. The stepper (plan/stepper.py) holds one per source and draws from their spreads by the
mixture; everything here concerns one source alone. Sans-I/O as the stepper is: waiting for a
record is a request (plan/requests.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from omniload.coordinator.plan.documents import Doc, DocumentSource
from omniload.coordinator.plan.packer import DocKey
from omniload.coordinator.plan.requests import Requests
from omniload.coordinator.plan.spread import Spread, UnitStore
from omniload.coordinator.plan.units import Unit, units_of
from omniload.errors import SourceFailed
from omniload.spec import Spec
from omniload.state import SpreadPosition

_POLL_MIN_S, _POLL_MAX_S = 200e-6, 10e-3
_CAP_READS = 64  # documents read on, at most, to find a unit under its document's cap


class SourceSpreads:
    """A source's spreads: the current epoch's, the next one's read ahead, and the reading into them."""

    def __init__(
        self,
        spec: Spec,
        intake: DocumentSource,
        store: UnitStore,
        horizon: Callable[[], tuple[int, int]],
        breath_due: Callable[[], bool],
        count_drop: Callable[[], None],
    ) -> None:
        """`horizon()`: a new spread's horizon and fill, at the job's size and weights now;
        `breath_due()`: whether to let others run; `count_drop()`: a document long_docs=drop dropped."""
        self._spec, self.intake, self._store = spec, intake, store
        self._horizon, self._breath_due, self._count_drop = horizon, breath_due, count_drop
        self.name = intake.catalog.name
        self._bucket_rows = spec.rows if spec.long_docs == "bucket" else 0
        self._image_hw = spec.image_hw if spec.has_images else None
        self.spread: Spread | None = None  # None: the next epoch's starts at the cursor
        # The next epoch's spread, read while the current one, its epoch all read, is drawn
        # empty (a token read for each drawn), so that its fill is ready when it is needed.
        self.next_spread: Spread | None = None
        # Right after the last document taken: where the next spread starts and what a
        # checkpoint says (a SKIP record past it included or not, as the intake's cursor may be).
        self.cursor: tuple[int, int] = intake.cursor

    @property
    def dry(self) -> bool:
        return self.intake.dry

    @property
    def live(self) -> bool:
        """Whether the source may still give a unit."""
        return not (self.dry and (self.spread is None or self.spread.exhausted) and self.next_spread is None)

    def position(self) -> SpreadPosition | None:
        """The spread's position (where a restore reads from; the next epoch's spread, read
        ahead, follows from it); None when the next spread starts afresh at the cursor (none
        yet, or the last one used up its epoch and nothing of the next was read)."""
        spread = self.spread
        if spread is None or spread.exhausted:
            spread = self.next_spread
        if spread is None or (not spread.waiting_units and self.cursor[0] >= spread.epoch_end):
            return None
        return spread.position(self.cursor)

    def seek(self, cursor: tuple[int, int]) -> None:
        """Forget the spreads and read from `cursor` (a restore)."""
        self.spread = self.next_spread = None
        self.intake.seek(*cursor)
        self.cursor = self.intake.cursor

    def rehydrate(self, position: SpreadPosition | None, until: tuple[int, int], wanted: set[DocKey]) -> Requests:
        """Re-read up to the saved cursor `until`: the spread at `position` is rebuilt, and the
        units of the `wanted` documents (the carried ones') are returned."""
        found: list[Unit] = []
        spread = None
        if position is not None:
            spread = self.spread = self.new_spread(position.start[0], position)
        while self.intake.cursor < until:
            if self._breath_due():
                yield 0.0
            doc = self.take(None) or (yield from self.await_doc(None))
            if doc is None:
                break
            if (doc.source, *doc.origin) in wanted:
                found += self.units(doc) or []
            if spread is None or position is None or doc.origin < position.start:
                continue
            if doc.group < spread.epoch_end:
                self.add(spread, doc, counting=False)
            else:  # the next epoch's, read ahead: every unit of it waits
                self.add(self.spread_after(spread), doc, counting=False)
        if spread is not None and position is not None:
            spread.restored()
            if position.ended:  # as the saved one was: when it ended is when the read-ahead began
                spread.end()
        return found

    def ready(self) -> Requests:
        """The spread once a unit of it is due: documents are taken until one is, or until its
        epoch has been read (then the next epoch's spread); None when the source has ended."""
        spread = self.spread
        while True:
            if spread is None or spread.exhausted:
                if (upcoming := self.next_spread) is not None:  # read ahead: its fill is in
                    spread = self.spread = upcoming
                    self.next_spread = None
                    continue
                if self.dry:
                    return None
                spread = self.spread = self.new_spread(max(self.cursor[0], self.intake.cursor[0]))
            if spread.ready():
                return spread
            if self._breath_due():
                yield 0.0
            if not self._take_into(spread):  # (read_into's, with no generator made when the record is here)
                yield from self.await_into(spread)

    def draw_reading_on(self, spread: Spread, in_step: dict[DocKey, int], cap: int) -> Requests:
        """A unit within the cap found by taking up to _CAP_READS more documents (each makes
        units due); else the cap gives way."""
        for _ in range(_CAP_READS):
            if spread.ended or not (yield from self.read_into(spread)):
                break
            if (unit := spread.draw(in_step, cap, give_way=False)) is not None:
                return unit
        return spread.draw(in_step, cap)

    def read_next_epoch(self, spread: Spread, tokens: int) -> Requests:
        """Read the next epoch's documents, a token for each drawn from the current spread since
        its epoch was read. It waits for a record that is not in its ring yet: what has been
        read is part of the position, so it must follow from the draws alone, never from
        which records happened to be there."""
        spread.drawn_since_end += tokens
        if self.dry:
            return
        upcoming = self.spread_after(spread)
        while not upcoming.ended and upcoming.clock < spread.drawn_since_end:
            yield from self.read_into(upcoming)

    def read_into(self, spread: Spread) -> Requests:
        """Add the source's next document of the spread's epoch, waiting for its record; at the
        epoch's end (or the source's), end the spread. Returns whether a document was added.
        A spread never spans epochs; a document that is here (the most) costs no wait."""
        return self._take_into(spread) or (yield from self.await_into(spread))

    def _take_into(self, spread: Spread) -> bool:
        """Add the source's next document of the spread's epoch if its record is here."""
        if (doc := self.take(spread.epoch_end)) is None:
            return False
        self.add(spread, doc)
        return True

    def await_into(self, spread: Spread) -> Requests:
        """read_into once take found nothing: wait for the record (one poll an attempt, as the
        autoscaler counts empty polls) and add its document, or end the spread."""
        doc = yield from self.await_doc(spread.epoch_end)
        if doc is None:
            spread.end()
            return False
        self.add(spread, doc)
        return True

    def spread_after(self, spread: Spread) -> Spread:
        """The spread of the epoch after `spread`'s, made when first needed."""
        if (upcoming := self.next_spread) is None:
            upcoming = self.next_spread = self.new_spread(spread.epoch_end)
        return upcoming

    def new_spread(self, group: int, position: SpreadPosition | None = None) -> Spread:
        """The spread of the epoch that holds `group` (a restored spread keeps its own horizon)."""
        return Spread(
            self.intake.catalog.index,
            self._spec.seed,
            *self._horizon(),
            self._store,
            self._spec.seq_len,
            self.intake.epoch_end(group),
            2 / self._spec.max_doc_share,  # a very long document takes at most half its cap a step
            self._bucket_rows,
            self._spec.rows,
            self._image_hw,
            position,
        )

    def _dropped(self, doc: Doc) -> bool:
        """Whether long_docs=drop drops this document."""
        return self._spec.long_docs == "drop" and len(doc.tokens) > self._spec.seq_len

    def add(self, spread: Spread, doc: Doc, counting: bool = True) -> None:
        """Put a document's units in the spread (long_docs=drop drops a long one: `counting`)."""
        if self._dropped(doc):
            if counting:
                self._count_drop()
            return
        try:
            spread.add(doc)
        except ValueError as exc:
            raise SourceFailed(self.name, str(exc)) from None

    def units(self, doc: Doc) -> list[Unit] | None:
        """The document's units; None when long_docs=drop drops it."""
        if self._dropped(doc):
            return None
        try:
            return units_of(doc, self._spec.seq_len, self._bucket_rows, self._spec.rows)
        except ValueError as exc:
            raise SourceFailed(self.name, str(exc)) from None

    def take(self, until_group: int | None) -> Doc | None:
        """The source's next document if its record is in its ring, else None."""
        if (doc := self.intake.poll(until_group)) is None:
            return None
        self.cursor = doc.after
        return doc

    def await_doc(self, until_group: int | None) -> Requests:
        """After take found nothing: wait for the source's next record; None if the source
        ran dry or its cursor reached `until_group`."""
        delay, since = _POLL_MIN_S, time.monotonic()
        while True:
            if self.intake.dry or (until_group is not None and self.intake.group >= until_group):
                return None
            waited = time.monotonic() - since
            if waited > self._spec.worker_timeout:
                raise SourceFailed(
                    self.name,
                    f"no sample arrived for {waited:.0f}s (worker timeout "
                    f"{self._spec.worker_timeout:.0f}s): is a transform stuck? "
                    "Raise --worker-timeout for very slow transforms",
                )
            yield delay
            delay = min(delay * 2, _POLL_MAX_S)
            if (doc := self.take(until_group)) is not None:
                return doc
