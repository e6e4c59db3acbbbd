"""The deterministic consumption order of a source (docs/architecture.md, Invariants:
deterministic).

A source is a list of shards (a file's row-group range). Epoch `e` visits the shards in a
permutation drawn from `(seed, source, e)` and the rows of each shard in a permutation drawn
from `(seed, source, e, shard)`, within the slices a worker reads the shard in (Slicing).
Shards are numbered globally across epochs, `g = e * num_shards + position`.

Shards are read `interleave` at a time: group `k` holds up to `interleave` consecutive shards of
one epoch, and its rows are taken from its shards in turn (row 0 of each, then row 1, ...), so
consecutive documents of a source come from different row groups and files. A source's
position is `(group, pos)`: the `pos`-th row of group `k`'s interleaved order. A source's lanes
take turns TURN positions at a time (lane_of): a group is often hundreds of MB of text, and a
lane can work ahead of the planner only as far as its ring holds, so lanes taking turns on
whole groups would produce one after another. Both the workers (which produce) and the
coordinator (which consumes) derive everything from these functions, so the order never
depends on worker count or timing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
from numpy.typing import NDArray

# sample_id = source << 52 | ordinal << 12 | chunk: stable across runs, unique within an epoch.
SOURCE_BITS, ORDINAL_BITS, CHUNK_BITS = 11, 40, 12
MAX_ORDINAL = 1 << ORDINAL_BITS
MAX_CHUNKS = 1 << CHUNK_BITS

_Rows = NDArray[np.integer[Any]]  # file row numbers


def shard_permutation(num_shards: int, seed: int, source: int, epoch: int) -> np.ndarray:
    rng = np.random.default_rng([seed, source, epoch, 0x5A4D])
    return rng.permutation(num_shards)


@dataclass(frozen=True, slots=True)
class Slicing:
    """How a worker reads a shard of `rows` rows: in slices of about `size` rows (0 or >= rows:
    one slice), holding one at a time. Strided, slice j holds rows j, j + count, j + 2 count...,
    so every slice spans the whole shard: files are often sorted (by path, package, URL) and a
    slice of neighbouring rows would fill the shuffle window with one topic. That reads the
    shard once per slice; formats read only from their start (a compressed file, a tar file)
    take runs of `size` rows instead."""

    rows: int
    size: int = 0
    strided: bool = False

    @property
    def count(self) -> int:
        return 1 if self.size <= 0 or self.size >= self.rows else -(-self.rows // self.size)

    @overload
    def locate(self, row: int) -> tuple[int, int]: ...
    @overload
    def locate(self, row: _Rows) -> tuple[_Rows, _Rows]: ...

    def locate(self, row: int | _Rows) -> tuple[int | _Rows, int | _Rows]:
        """(slice, index within that slice) of file row `row`, or of each row of an array."""
        count = self.count
        if self.strided or count == 1:
            return row % count, row // count
        return row // self.size, row % self.size

    def members(self, j: int) -> range:
        """The file rows of slice j, in file order."""
        if self.strided or self.count == 1:
            return range(j, self.rows, self.count)
        return range(j * self.size, min(self.rows, (j + 1) * self.size))


def row_permutation(
    num_rows: int, seed: int, source: int, epoch: int, shard: int, slicing: Slicing | None = None
) -> np.ndarray:
    """A shard's rows (file row numbers) in the order they are consumed: the slices one after
    another, each one's rows shuffled; the coordinator's shuffle window mixes across slices."""
    if num_rows <= 1:  # (a shard of one row, an object of one document: no generator to seed, ~15 us)
        return np.arange(num_rows, dtype=index_dtype(num_rows))
    rng = np.random.default_rng([seed, source, epoch, shard, 0x2057])
    if slicing is None or slicing.count == 1:
        rows = np.arange(num_rows, dtype=index_dtype(num_rows))
        rng.shuffle(rows)  # Generator.permutation's own way, without its int64 copy
        return rows
    keys = rng.random(num_rows)
    return np.lexsort((keys, slicing.locate(np.arange(num_rows))[0])).astype(index_dtype(num_rows))


def index_dtype(size: int) -> np.dtype:
    """The dtype of the indexes into `size` rows or positions a worker holds for each shard and
    group it reads (row_permutation, interleave_rows): int32 where they fit, half of int64's
    memory, which large row groups make a worker's largest arrays (docs/benchmarks.md, Loader
    memory)."""
    return np.dtype(np.int32 if size < 2**31 else np.int64)


class ShardOrder:
    """(epoch, shard index) of each global shard number of one source, keeping the permutations
    of the last epochs asked for. A reader asks for every shard of an epoch in turn, and drawing
    an epoch's permutation costs O(shards): drawn again for each shard, as it once was, a start
    on 10,000 one-shard objects spent 40% of its workers' time there, growing with the square of
    the objects."""

    _KEPT = 2  # epochs: a group's shards are in one, and the next group's may be in the next

    def __init__(self, num_shards: int, seed: int, source: int) -> None:
        self.num_shards, self._seed, self._source = num_shards, seed, source
        self._permutations: dict[int, np.ndarray] = {}

    def at(self, g: int) -> tuple[int, int]:
        """(epoch, shard index) of global shard number `g`."""
        epoch, position = divmod(g, self.num_shards)
        permutation = self._permutations.get(epoch)
        if permutation is None:
            if len(self._permutations) >= self._KEPT:
                del self._permutations[min(self._permutations)]
            permutation = self._permutations[epoch] = shard_permutation(
                self.num_shards, self._seed, self._source, epoch
            )
        return epoch, int(permutation[position])


def groups_per_epoch(num_shards: int, interleave: int) -> int:
    return -(-num_shards // interleave)


def group_members(k: int, num_shards: int, interleave: int) -> range:
    """The global shard numbers of group `k` (never across an epoch boundary)."""
    epoch, j = divmod(k, groups_per_epoch(num_shards, interleave))
    start = epoch * num_shards + j * interleave
    return range(start, min(start + interleave, (epoch + 1) * num_shards))


def interleave_rows(rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(member, row) at each position of a group whose shards have `rows` rows: the shards
    take turns, one row each, until each runs out."""
    dtype = index_dtype(sum(rows))
    member = np.repeat(np.arange(len(rows), dtype=dtype), rows)
    row = np.concatenate([np.arange(n, dtype=dtype) for n in rows]) if len(rows) else np.zeros(0, dtype=dtype)
    order = np.lexsort((member, row))
    return member[order], row[order]


TURN = 128  # positions a lane produces before the next lane's turn: its ring holds about a turn of
# 1k-token documents at least (worker_pool.ring_span), so a source's lanes on several workers produce at once


def lane_of(k: int, pos: int, num_lanes: int) -> int:
    """The lane that produces position `pos` of group `k`."""
    return (k + pos // TURN) % num_lanes


def turns_of_lane(lane: int, num_lanes: int, k: int, size: int, from_pos: int = 0) -> Iterator[range]:
    """The positions of group `k` (of `size` positions) that lane `lane` produces, from
    `from_pos` on, one turn at a time."""
    turn = from_pos // TURN
    turn += (lane - k - turn) % num_lanes
    while turn * TURN < size:
        yield range(max(turn * TURN, from_pos), min((turn + 1) * TURN, size))
        turn += num_lanes


def sample_id(source: int, ordinal: int, chunk: int) -> int:
    return (source << (ORDINAL_BITS + CHUNK_BITS)) | (ordinal << CHUNK_BITS) | chunk


def split_sample_id(value: int) -> tuple[int, int, int]:
    """(source, ordinal, chunk) of a sample_id: the inverse of `sample_id`."""
    return value >> (ORDINAL_BITS + CHUNK_BITS), (value >> CHUNK_BITS) & (MAX_ORDINAL - 1), value & (MAX_CHUNKS - 1)
