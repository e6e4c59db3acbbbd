"""Packing documents into fixed rows, and building a rank's batch arrays; pure.

A document longer than a row is split into row-sized chunks, each its own segment. Segments
are placed into `dp * rows` bins by first-fit decreasing; what does not fit waits for the next
step (the carry-over), which is placed first then, so nothing waits for long. Bin `b` is row
`b // dp` of data-parallel rank `b % dp`, so the first-filled bins are spread over the ranks.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

IGNORE_INDEX = -100
PAD_ID = 0


@dataclass(frozen=True, slots=True)
class Segment:
    """A document or a chunk of one; `tokens` is carried along, never inspected by planning."""

    source: int
    sample_id: int
    length: int
    tokens: np.ndarray = field(compare=False, repr=False)


def chunk_bounds(length: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, stop) of the row-sized chunks of a document of `length` tokens."""
    return [(start, min(start + seq_len, length)) for start in range(0, length, seq_len)]


def first_fit_decreasing(lengths: Sequence[int], free: list[int]) -> list[int]:
    """Bin index for each length (-1 if it fits nowhere); `free` is updated in place.

    Ties keep input order, so the result is a function of the inputs alone."""
    placed = [-1] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        need = lengths[i]
        for b, room in enumerate(free):
            if room >= need:
                free[b] = room - need
                placed[i] = b
                break
    return placed


@dataclass(frozen=True, slots=True)
class StepPlan:
    rows: list[list[list[Segment]]]  # [dp rank][row] -> segments in order
    carry: list[Segment]  # chosen for this step but did not fit; first in line next step


def plan_step(carry: Sequence[Segment], fresh: Sequence[Segment], dp: int, rows: int, seq_len: int) -> StepPlan:
    free = [seq_len] * (dp * rows)
    bins: list[list[Segment]] = [[] for _ in free]
    left: list[Segment] = []
    for group in (carry, fresh):
        for segment, b in zip(group, first_fit_decreasing([s.length for s in group], free)):
            (bins[b] if b >= 0 else left).append(segment)
    per_rank = [[bins[row * dp + rank] for row in range(rows)] for rank in range(dp)]
    return StepPlan(per_rank, left)


def build_batch(rows: Sequence[Sequence[Segment]], seq_len: int) -> dict[str, np.ndarray]:
    """The arrays a rank receives; see README 'Batch schema'."""
    n = len(rows) * seq_len
    input_ids = np.full(n, PAD_ID, dtype=np.int64)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty(n, dtype=np.int64)
    ramp = np.arange(seq_len, dtype=np.int64)
    lengths: list[int] = []
    sources: list[int] = []
    sample_ids: list[int] = []
    for r, row in enumerate(rows):
        offset = r * seq_len
        for segment in row:
            stop = offset + segment.length
            input_ids[offset:stop] = segment.tokens
            labels[offset : stop - 1] = segment.tokens[1:]
            position_ids[offset:stop] = ramp[: segment.length]
            lengths.append(segment.length)
            sources.append(segment.source)
            sample_ids.append(segment.sample_id)
            offset = stop
        pad = (r + 1) * seq_len - offset
        if pad:
            position_ids[offset : offset + pad] = ramp[:pad]
            lengths.append(pad)
            sources.append(-1)
            sample_ids.append(-1)
    cu_seqlens = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    return {
        "input_ids": input_ids.reshape(len(rows), seq_len),
        "labels": labels.reshape(len(rows), seq_len),
        "position_ids": position_ids.reshape(len(rows), seq_len),
        "cu_seqlens": cu_seqlens,
        "source": np.asarray(sources, dtype=np.int64),
        "sample_id": np.asarray(sample_ids, dtype=np.int64),
    }
