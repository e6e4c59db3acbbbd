"""Segments (documents or chunks of them) and the ranks' batch arrays built from their rows; pure.

A document longer than a row is split into row-sized chunks, each its own segment. Where the
segments go is the planner's decision (step_plan.py, balance.py); this module turns a step's
rows of segments, every rank's at once, into the arrays of the batch schema.
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
    bounds = [0]
    for row in rows:
        bounds.append(bounds[-1] + len(row))
    return compact_batches([s for row in rows for s in row], bounds, len(rows), [seq_len], image_hw, masked)[0]


def compact_batches(
    segments: Sequence[Segment],
    bounds: Sequence[int],
    rows: int,
    widths: Sequence[int],
    image_hw: tuple[int, int] | None = None,
    masked: bool = False,
) -> list[dict[str, np.ndarray]]:
    """Every rank's compact_batch at once: row k is segments[bounds[k] : bounds[k + 1]], each
    rank `rows` rows of its width (widths: one a rank). A step at dp=256 holds thousands of
    segments, and a batch built segment by segment was a large share of the planning thread
    (scripts/bench_planner.py); here the per-segment work is reading its attributes
    into arrays, the offsets and padding are numpy's, and the tokens are copied by one
    np.concatenate. The ranks' arrays are views into the step's: one buffer a step."""
    n = len(segments)
    b = np.asarray(bounds, dtype=np.int64)
    length = np.fromiter((s.length for s in segments), np.int64, n)
    ends = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(length, out=ends[1:])
    row_width = np.repeat(np.asarray(widths, dtype=np.int64), rows)
    pad = row_width - (ends[b[1:]] - ends[b[:-1]])
    if (pad < 0).any():
        raise ValueError(f"row {int(np.argmax(pad < 0))} holds more tokens than its width")
    # entries (what cu_seqlens bounds): each row's segments, then its padding if it has any
    padded = pad > 0
    pads_before: np.ndarray = np.cumsum(padded) - padded
    at = np.arange(n) + np.repeat(pads_before, np.diff(b))
    pad_at = b[1:][padded] + pads_before[padded]
    entries = n + len(pad_at)
    entry_length = np.empty(entries, dtype=np.int64)
    entry_length[at], entry_length[pad_at] = length, pad[padded]
    source = np.full(entries, -1, dtype=np.int32)
    source[at] = np.fromiter((s.source for s in segments), np.int32, n)
    sample_id = np.full(entries, -1, dtype=np.int64)
    sample_id[at] = np.fromiter((s.sample_id for s in segments), np.int64, n)
    start = np.zeros(entries, dtype=np.int32)
    start[at] = np.fromiter((s.position_start for s in segments), np.int32, n)
    cu = np.zeros(entries + 1, dtype=np.int64)
    np.cumsum(entry_length, out=cu[1:])
    first_entry = (b[:-1] + pads_before)[::rows].tolist() + [entries] if rows else [0] * (len(widths) + 1)
    first_slot = np.zeros(len(widths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(widths, dtype=np.int64) * rows, out=first_slot[1:])

    input_ids = _rows_joined([s.tokens for s in segments], bounds, pad, PAD_ID, np.int32, int(first_slot[-1]))
    trained = None
    if masked:  # a text segment is trained on every token
        ones = np.ones(int(length.max(initial=0)), dtype=np.uint8)
        marks = [ones[: s.length] if s.mask is None else s.mask for s in segments]
        trained = _rows_joined(marks, bounds, pad, 0, np.uint8, int(first_slot[-1]))
    with_images = [(i, s.images) for i, s in enumerate(segments) if s.images is not None] if image_hw else []
    image_entry = np.fromiter((at[i] for i, _ in with_images), np.int64, len(with_images))
    image_counts = [len(images) for _, images in with_images]

    batches: list[dict[str, np.ndarray]] = []
    for r, width in enumerate(widths):
        e0, e1, s0, s1 = first_entry[r], first_entry[r + 1], int(first_slot[r]), int(first_slot[r + 1])
        wire: dict[str, np.ndarray] = {
            "input_ids": input_ids[s0:s1].reshape(rows, width),
            "cu_seqlens": (cu[e0 : e1 + 1] - cu[e0]).astype(np.int32),
            "source": source[e0:e1],
            "sample_id": sample_id[e0:e1],
        }
        if start[e0:e1].any():
            wire["position_start"] = start[e0:e1]
        if trained is not None:
            wire["label_mask"] = np.packbits(trained[s0:s1])
        if image_hw is not None:
            first, stop = np.searchsorted(image_entry, [e0, e1]).tolist()  # entries increase with the rank
            pixels = [images for _, images in with_images[first:stop]]
            wire["pixel_values"] = np.concatenate(pixels) if pixels else np.zeros((0, 3, *image_hw), np.uint8)
            wire["image_index"] = np.repeat(image_entry[first:stop] - e0, image_counts[first:stop])
        batches.append(wire)
    return batches


def _rows_joined(
    parts: Sequence[np.ndarray], bounds: Sequence[int], pad: np.ndarray, fill: int, dtype: type[np.integer], size: int
) -> np.ndarray:
    """Row k's parts (parts[bounds[k] : bounds[k + 1]]) then pad[k] of `fill`, every row in one array."""
    filler: np.ndarray = np.full(int(pad.max(initial=0)), fill, dtype=dtype)
    joined: list[np.ndarray] = []
    for k, gap in enumerate(pad.tolist()):
        joined += parts[bounds[k] : bounds[k + 1]]
        if gap:
            joined.append(filler[:gap])
    out: np.ndarray = np.empty(size, dtype=dtype)
    if joined:
        np.concatenate(joined, out=out, casting="same_kind")
    return out


def build_batch(
    rows: Sequence[Sequence[Segment]], seq_len: int, image_hw: tuple[int, int] | None = None, masked: bool = False
) -> dict[str, np.ndarray]:
    """The arrays a rank receives; see README 'Batch schema'."""
    return expand(compact_batch(rows, seq_len, image_hw, masked))
