"""The deterministic consumption order of a source (DESIGN.md invariant 1).

A source is a list of shards (a file's row-group range). Epoch `e` visits the shards in a
permutation drawn from `(seed, source, e)` and the rows of each shard in a permutation drawn
from `(seed, source, e, shard)`, within bounded slices of the shard (see row_permutation). Shards are numbered globally across epochs,
`g = e * num_shards + position`.

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

import numpy as np

# sample_id = source << 52 | ordinal << 12 | chunk: stable across runs, unique within an epoch.
SOURCE_BITS, ORDINAL_BITS, CHUNK_BITS = 11, 40, 12
MAX_SOURCES = 1 << SOURCE_BITS
MAX_ORDINAL = 1 << ORDINAL_BITS
MAX_CHUNKS = 1 << CHUNK_BITS


def shard_permutation(num_shards: int, seed: int, source: int, epoch: int) -> np.ndarray:
    rng = np.random.default_rng([seed, source, epoch, 0x5A4D])
    return rng.permutation(num_shards)


def row_permutation(num_rows: int, seed: int, source: int, epoch: int, shard: int,
                    slice_rows: int = 0) -> np.ndarray:
    """A shard's rows in the order they are consumed. With `slice_rows` (0: the whole shard is
    one slice) the rows are shuffled within consecutive slices of that many rows and the slices
    come in file order, so a worker streams a shard holding one slice at a time; the
    coordinator's shuffle window mixes across slices."""
    rng = np.random.default_rng([seed, source, epoch, shard, 0x2057])
    if slice_rows <= 0 or slice_rows >= num_rows:
        return rng.permutation(num_rows)
    keys = rng.random(num_rows)
    return np.lexsort((keys, np.arange(num_rows) // slice_rows))


def shard_at(g: int, num_shards: int, seed: int, source: int) -> tuple[int, int]:
    """Return (epoch, shard index) of global shard number `g`."""
    epoch, position = divmod(g, num_shards)
    return epoch, int(shard_permutation(num_shards, seed, source, epoch)[position])


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
    member = np.repeat(np.arange(len(rows)), rows)
    row = np.concatenate([np.arange(n) for n in rows]) if len(rows) else np.zeros(0, dtype=np.int64)
    order = np.lexsort((member, row))
    return member[order], row[order]


TURN = 256  # positions a lane produces before the next lane's turn: a few MB of tokens at most


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
