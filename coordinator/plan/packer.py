"""Segments (documents or chunks of them) and a rank's batch arrays built from its rows; pure.

A document longer than a row is split into row-sized chunks, each its own segment. Where the
segments go is the planner's decision (step_plan.py, balance.py); this module turns one rank's
rows of segments into the arrays of the batch schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omniload.batch_arrays import IGNORE_INDEX, PAD_ID, expand  # noqa: F401  (IGNORE_INDEX: the packer's too)


# Not frozen, though never changed after it is made (dataclasses.replace makes a changed copy):
# a frozen dataclass sets each field through object.__setattr__, and one Segment is made per
# document on the planner's thread (1.2 us frozen, 0.4 us not). Not hashable: none is a key.
@dataclass(slots=True)
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
    images: np.ndarray | None = field(default=None, compare=False, repr=False)  # uint8 [n, 3, H, W] it holds
    mask: np.ndarray | None = field(default=None, compare=False, repr=False)  # a conversation's: 1 = trained target

    @property
    def image_count(self) -> int:
        return 0 if self.images is None else len(self.images)


DocKey = tuple[int, int, int]  # (source, group, pos) of a document


def doc_key(segment: Segment) -> DocKey:
    """(source, group, pos): the document a segment is part of, wherever its chunks went."""
    return (segment.source, *segment.origin)


def chunk_bounds(length: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, stop) of the row-sized chunks of a document of `length` tokens."""
    return [(start, min(start + seq_len, length)) for start in range(0, length, seq_len)]


def compact_batch(
    rows: Sequence[Sequence[Segment]], seq_len: int, image_hw: tuple[int, int] | None = None, masked: bool = False
) -> dict[str, np.ndarray]:
    """A rank's batch as it travels (omniload.batch_arrays): token ids, segment bounds and ids; with
    `image_hw` (a job with image sources) also its images, in the order of their placeholder
    tokens in input_ids read row by row, and the segment each belongs to; with `masked` (a job
    with conversations trained on their replies) the label mask, a bit per token: a segment
    without a mask (text) is trained on every token."""
    input_ids = np.full((len(rows), seq_len), PAD_ID, dtype=np.int32)
    flat = input_ids.reshape(-1)
    trained = np.zeros(len(rows) * seq_len, dtype=bool) if masked else None
    lengths: list[int] = []
    sources: list[int] = []
    sample_ids: list[int] = []
    starts: list[int] = []
    images: list[np.ndarray] = []
    image_index: list[int] = []
    for r, row in enumerate(rows):
        offset = r * seq_len
        for segment in row:
            flat[offset : offset + segment.length] = segment.tokens
            if trained is not None:
                trained[offset : offset + segment.length] = True if segment.mask is None else segment.mask
            offset += segment.length
            if segment.images is not None:
                images.append(segment.images)
                image_index += [len(lengths)] * len(segment.images)
            lengths.append(segment.length)
            sources.append(segment.source)
            sample_ids.append(segment.sample_id)
            starts.append(segment.position_start)
        pad = (r + 1) * seq_len - offset
        if pad:
            lengths.append(pad)
            sources.append(-1)
            sample_ids.append(-1)
            starts.append(0)
    cu_seqlens = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    wire: dict[str, np.ndarray] = {
        "input_ids": input_ids,
        "cu_seqlens": cu_seqlens,
        "source": np.asarray(sources, dtype=np.int32),
        "sample_id": np.asarray(sample_ids, dtype=np.int64),
    }
    if any(starts):
        wire["position_start"] = np.asarray(starts, dtype=np.int32)
    if trained is not None:
        wire["label_mask"] = np.packbits(trained)
    if image_hw is not None:
        wire["pixel_values"] = np.concatenate(images) if images else np.zeros((0, 3, *image_hw), np.uint8)
        wire["image_index"] = np.asarray(image_index, dtype=np.int64)
    return wire


def build_batch(
    rows: Sequence[Sequence[Segment]], seq_len: int, image_hw: tuple[int, int] | None = None, masked: bool = False
) -> dict[str, np.ndarray]:
    """The arrays a rank receives; see README 'Batch schema'."""
    return expand(compact_batch(rows, seq_len, image_hw, masked))
