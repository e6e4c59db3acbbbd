"""Take each source's documents from the rings in the source's deterministic order.

The cursor `(group, pos)` is the next sample to consume: position `pos` of group `group` (see
omniload.order). Each position belongs to one lane (order.lane_of), whose worker writes its
positions in order, so the next record of that lane's ring is always the one wanted: no
reordering, and no buffer beyond the rings.

A record that fails the ring's checks (omniload/formats/ring.py) is never taken: the lane reads
as empty from then on, and `on_corrupt(source, lane, why)` asks for its worker to be replaced,
which resets the ring; the new worker produces from the cursor, so nothing is lost or repeated.
Rings are read under `lock`, which resets take too: a replay reads on a thread while the loop
may reset a dead worker's rings.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from omniload.coordinator.plan.documents import Doc
from omniload.coordinator.pool.catalog import SourceCatalog
from omniload.errors import SourceFailed
from omniload.formats.records import HEAD_SIZE, RecordFlag, RecordKind, decode, images_of, mask_of, tokens_of
from omniload.formats.ring import Ring, RingCorrupt
from omniload.order import ShardOrder, group_members, groups_per_epoch, lane_of

log = logging.getLogger("omniload")
# looked up once: an enum member read off its class costs ~70 ns, and poll reads three a document
_ERROR, _SKIP, _CHAT = RecordKind.ERROR, RecordKind.SKIP, RecordKind.CHAT


Corrupt = Callable[[int, int, str], None]  # (source, lane, why)


class SourceIntake:
    def __init__(
        self,
        catalog: SourceCatalog,
        rings: list[Ring],
        seed: int,
        interleave: int,
        lock: threading.Lock | None = None,
        on_corrupt: Corrupt | None = None,
    ) -> None:
        self.catalog = catalog
        self.rings = rings
        self._lock = lock or threading.Lock()
        self.on_corrupt = on_corrupt
        self.interleave = interleave
        self.docs = self.tokens = self.images = 0  # taken so far (figures.py makes rates of them)
        self.chats_truncated = self.chats_dropped = 0  # conversations longer than seq_len (--long-chats)
        self.empty_polls = 0  # polls that found the due ring empty: the planner waited on this source
        self._end = catalog.epochs * groups_per_epoch(len(catalog.shards), interleave) if catalog.epochs else None
        self._order = ShardOrder(len(catalog.shards), seed, catalog.index)
        self._rows = catalog.shards.column("rows")
        self._group_rows: tuple[int, int] = (-1, 0)
        self.group, self.pos = 0, 0
        self._advance(0)

    @property
    def cursor(self) -> tuple[int, int]:
        return self.group, self.pos

    def seek(self, group: int, pos: int) -> None:
        """Move the cursor; only while this source's workers are stopped and its rings empty."""
        self.group, self.pos = group, pos
        self._advance(0)

    def resume_at(self, lane: int) -> tuple[int, int]:
        """Where a new producer of `lane` goes on when its ring keeps the records already in it
        (a re-split moves the lane to another worker): right after the newest record, else
        (the ring read empty) at the cursor. The lane produces only its own turns from there.
        Only while the lane has no producer."""
        with self._lock:
            data = self.rings[lane].newest(HEAD_SIZE)
        if data is None:
            return self.cursor
        record = decode(data)
        return record.group, record.pos + 1

    def epoch_end(self, group: int) -> int:
        """The first group of the epoch after `group`'s."""
        per_epoch = groups_per_epoch(len(self.catalog.shards), self.interleave)
        return (group // per_epoch + 1) * per_epoch

    @property
    def dry(self) -> bool:
        return self._end is not None and self.group >= self._end

    def poll(self, until_group: int | None = None, waiting: bool = True) -> Doc | None:
        """The next document if its record has arrived, else None (also when dry, or when the
        cursor has reached `until_group`). `waiting`: the planner waits on this source, so an
        empty ring counts in empty_polls (the autoscaler's sign of a starved source); a
        read-ahead's poll does not."""
        while not self.dry and (until_group is None or self.group < until_group):
            data = self._read(lane_of(self.group, self.pos, len(self.rings)))
            if data is None:
                self.empty_polls += waiting
                return None
            record = decode(data)
            kind = record.kind
            if kind is _ERROR:
                message = bytes(record.payload).decode(errors="replace")
                raise SourceFailed(self.catalog.name, message, bad_input=bool(record.flags & RecordFlag.BAD_INPUT))
            if record.group != self.group or record.pos != self.pos:
                raise SourceFailed(
                    self.catalog.name,
                    f"record {record.group}:{record.pos} arrived where "
                    f"{self.group}:{self.pos} was due (a bug in omniload; please report it)",
                )
            self._advance(1)
            if kind is _SKIP:
                self.chats_dropped += bool(record.flags & RecordFlag.DROPPED)
                if record.payload:  # said once per unreadable file
                    log.warning("source '%s': %s", self.catalog.name, bytes(record.payload).decode(errors="replace"))
                continue
            tokens = tokens_of(record)
            self.docs += 1
            self.tokens += len(tokens)
            if kind is _CHAT:
                self.chats_truncated += bool(record.flags & RecordFlag.TRUNCATED)
                return Doc(
                    self.catalog.index,
                    record.ordinal,
                    tokens,
                    record.group,
                    record.pos,
                    after=self.cursor,
                    mask=mask_of(record),
                )
            if record.images:
                config = self.catalog.images
                assert config is not None  # only an image source's workers write records with images
                at, pixels = images_of(record, config.height, config.width)
                self.images += record.images
                return Doc(
                    self.catalog.index, record.ordinal, tokens, record.group, record.pos, at, pixels, self.cursor
                )
            return Doc(self.catalog.index, record.ordinal, tokens, record.group, record.pos, after=self.cursor)
        return None

    def _read(self, lane: int) -> bytes | None:
        """The lane's next record; None while its ring is empty, or corrupt until it is reset."""
        ring = self.rings[lane]
        with self._lock:
            if ring.corrupt:
                return None
            try:
                return ring.read()
            except RingCorrupt as exc:
                why = str(exc)
        log.warning("source '%s': %s; replacing the lane's worker", self.catalog.name, why)
        if self.on_corrupt is not None:
            self.on_corrupt(self.catalog.index, lane, why)
        return None

    def _shard_rows(self, g: int) -> int:
        return int(self._rows[self._order.at(g)[1]])

    def _rows_of_group(self, k: int) -> int:
        if self._group_rows[0] != k:
            members = group_members(k, len(self.catalog.shards), self.interleave)
            self._group_rows = (k, sum(self._shard_rows(g) for g in members))
        return self._group_rows[1]

    def _advance(self, count: int) -> None:
        self.pos += count
        if self._group_rows[0] == self.group and self.pos < self._group_rows[1]:
            return  # still inside the group (most calls: one a document)
        while not self.dry and self.pos >= self._rows_of_group(self.group):
            self.pos -= self._rows_of_group(self.group)
            self.group += 1
