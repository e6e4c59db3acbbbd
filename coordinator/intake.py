"""Take each source's documents from the rings in the source's deterministic order.

The cursor `(g, row)` is the next sample to consume: row `row` of global shard `g`. Shard `g`
belongs to lane `g % lanes`, whose worker writes its shards in order, so the next record of
that lane's ring is always the one wanted: no reordering, and no buffer beyond the rings.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from omniload.errors import SourceFailed
from omniload.order import lane_of, shard_permutation
from omniload.workers.records import RecordKind, decode, tokens_of
from omniload.workers.ring import Ring

from omniload.coordinator.catalog import SourceCatalog

log = logging.getLogger("omniload")


@dataclass(frozen=True, slots=True)
class Doc:
    source: int
    ordinal: int
    tokens: np.ndarray
    g: int = 0  # where the document sits in its source's order
    row: int = 0


class SourceIntake:
    def __init__(self, catalog: SourceCatalog, rings: list[Ring], seed: int, g: int = 0, row: int = 0) -> None:
        self.catalog = catalog
        self.rings = rings
        self._seed = seed
        self._end = catalog.epochs * len(catalog.shards) if catalog.epochs else None
        self._rows_by_epoch: tuple[int, np.ndarray] | None = None
        self.g, self.row = g, row
        self._advance(0)

    @property
    def cursor(self) -> tuple[int, int]:
        return self.g, self.row

    def seek(self, g: int, row: int) -> None:
        """Move the cursor; only while this source's workers are stopped and its rings empty."""
        self.g, self.row = g, row
        self._advance(0)

    @property
    def dry(self) -> bool:
        return self._end is not None and self.g >= self._end

    def poll(self) -> Doc | None:
        """The next document if its record has arrived, else None (also when dry)."""
        while not self.dry:
            data = self.rings[lane_of(self.g, len(self.rings))].read()
            if data is None:
                return None
            record = decode(data)
            if record.kind is RecordKind.ERROR:
                raise SourceFailed(self.catalog.name, bytes(record.payload).decode(errors="replace"))
            if (record.g, record.row) != (self.g, self.row):
                raise SourceFailed(self.catalog.name, f"record {record.g}:{record.row} arrived where "
                                   f"{self.g}:{self.row} was due (a bug in omniload; please report it)")
            if record.kind is RecordKind.SKIP:
                log.warning("source '%s': skipped %d rows: %s", self.catalog.name, record.count,
                            bytes(record.payload).decode(errors="replace"))
                self._advance(record.count)
                continue
            self._advance(1)
            return Doc(self.catalog.index, record.ordinal, tokens_of(record), record.g, record.row)
        return None

    def _shard_rows(self, g: int) -> int:
        n = len(self.catalog.shards)
        epoch, position = divmod(g, n)
        if self._rows_by_epoch is None or self._rows_by_epoch[0] != epoch:
            order = shard_permutation(n, self._seed, self.catalog.index, epoch)
            rows = np.array([s.rows for s in self.catalog.shards])[order]
            self._rows_by_epoch = (epoch, rows)
        return int(self._rows_by_epoch[1][position])

    def _advance(self, count: int) -> None:
        self.row += count
        while not self.dry and self.row >= self._shard_rows(self.g):
            self.row -= self._shard_rows(self.g)
            self.g += 1
