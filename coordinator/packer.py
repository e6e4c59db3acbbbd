"""Segments (documents or chunks of them) and a rank's batch arrays built from its rows; pure.

A document longer than a row is split into row-sized chunks, each its own segment. Where the
segments go is the planner's decision (planner.py, balance.py); this module turns one rank's
rows of segments into the arrays of the batch schema.
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
    position_start: int = 0  # > 0 for a later chunk of a document kept whole (long_docs=bucket)
    group: int = -1  # chunks of one bucketed document share a group id (their first sample_id)
    delay: int = 0  # steps this segment has waited in the carry-over
    origin: tuple[int, int] = (0, 0)  # (group, pos) of its document, to find it again on restore


def doc_key(segment: Segment) -> tuple[int, int, int]:
    """(source, group, pos): the document a segment is part of, wherever its chunks went."""
    return (segment.source, *segment.origin)


def chunk_bounds(length: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, stop) of the row-sized chunks of a document of `length` tokens."""
    return [(start, min(start + seq_len, length)) for start in range(0, length, seq_len)]


def build_batch(rows: Sequence[Sequence[Segment]], seq_len: int) -> dict[str, np.ndarray]:
    """The arrays a rank receives; see README 'Batch schema'."""
    n = len(rows) * seq_len
    input_ids = np.full(n, PAD_ID, dtype=np.int64)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty(n, dtype=np.int64)
    ramp = np.arange(seq_len, dtype=np.int64)
    longest = max((s.position_start + s.length for row in rows for s in row), default=0)
    if longest > seq_len:
        ramp = np.arange(longest, dtype=np.int64)
    lengths: list[int] = []
    sources: list[int] = []
    sample_ids: list[int] = []
    for r, row in enumerate(rows):
        offset = r * seq_len
        for segment in row:
            stop = offset + segment.length
            input_ids[offset:stop] = segment.tokens
            labels[offset : stop - 1] = segment.tokens[1:]
            position_ids[offset:stop] = ramp[segment.position_start : segment.position_start + segment.length]
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
