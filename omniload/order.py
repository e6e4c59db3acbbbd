"""The deterministic consumption order of a source (DESIGN.md invariant 1).

A source is a list of shards (a file's row-group range). Epoch `e` visits the shards in a
permutation drawn from `(seed, source, e)` and the rows of each shard in a permutation drawn
from `(seed, source, e, shard)`. Shards are numbered globally across epochs,
`g = e * num_shards + position`, and shard `g` belongs to lane `g % num_lanes`. Both the
workers (which produce) and the coordinator (which consumes) derive everything from these
functions, so the order never depends on worker count or timing.
"""
from __future__ import annotations

import numpy as np

# sample_id = source << 52 | ordinal << 12 | chunk: stable across runs, unique within an epoch.
SOURCE_BITS, ORDINAL_BITS, CHUNK_BITS = 11, 40, 12
MAX_SOURCES = 1 << SOURCE_BITS
MAX_ORDINAL = 1 << ORDINAL_BITS
MAX_CHUNKS = 1 << CHUNK_BITS


def shard_permutation(num_shards: int, seed: int, source: int, epoch: int) -> np.ndarray:
    rng = np.random.default_rng([seed, source, epoch, 0x5A4D])
    return rng.permutation(num_shards)


def row_permutation(num_rows: int, seed: int, source: int, epoch: int, shard: int) -> np.ndarray:
    rng = np.random.default_rng([seed, source, epoch, shard, 0x2057])
    return rng.permutation(num_rows)


def shard_at(g: int, num_shards: int, seed: int, source: int) -> tuple[int, int]:
    """Return (epoch, shard index) of global shard number `g`."""
    epoch, position = divmod(g, num_shards)
    return epoch, int(shard_permutation(num_shards, seed, source, epoch)[position])


def lane_of(g: int, num_lanes: int) -> int:
    return g % num_lanes


def first_shard_of_lane(lane: int, num_lanes: int, from_g: int) -> int:
    """The first global shard number >= from_g that lane `lane` owns."""
    return from_g + (lane - from_g) % num_lanes


def sample_id(source: int, ordinal: int, chunk: int) -> int:
    return (source << (ORDINAL_BITS + CHUNK_BITS)) | (ordinal << CHUNK_BITS) | chunk
