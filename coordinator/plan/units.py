"""A document cut into units, the pieces the planner draws; pure.

A unit is one segment: a whole document, or one row-sized chunk of a longer one; with
long_docs=bucket, a run of up to `bucket_rows` chunks of one document kept together (whole rows
of one rank, positions running on); a sample with images, or a conversation, is always one
unit. `unit_count` says how many units a document makes without making them, and `chunk_unit`
makes one unit of a long document from its tokens alone (plan/spread.py keeps waiting
documents' tokens in a store and makes a unit only when it is drawn).
"""

from __future__ import annotations

import numpy as np

from omniload.coordinator.plan.documents import Doc
from omniload.coordinator.plan.packer import Segment, chunk_bounds
from omniload.order import MAX_CHUNKS, sample_id

Unit = tuple[Segment, ...]


def unit_count(length: int, seq_len: int, bucket_rows: int = 0, whole: bool = False) -> int:
    """How many units a document of `length` tokens makes (as units_of makes them); `whole`: a
    sample with images or a conversation, one unit. Raises ValueError for a document of more
    chunks than a sample id can number."""
    if length == 0:
        return 0
    chunks = -(-length // seq_len)
    if chunks > MAX_CHUNKS:
        raise ValueError(f"a document of {length} tokens makes more than {MAX_CHUNKS} chunks of --seq-len {seq_len}")
    if whole:
        return 1
    return chunks if not bucket_rows or chunks < 2 else -(-chunks // bucket_rows)


def unit_span(length: int, seq_len: int, bucket_rows: int, j: int) -> tuple[int, int]:
    """(start, stop) of unit j's tokens in a text document of `length` tokens."""
    per = seq_len * (bucket_rows if bucket_rows and length > seq_len else 1)
    return j * per, min(length, (j + 1) * per)


def chunk_unit(
    source: int, ordinal: int, origin: tuple[int, int], tokens: np.ndarray, j: int, seq_len: int, bucket_rows: int = 0
) -> Unit:
    """Unit j of a text document (no images, no mask), made from its tokens alone (unit_span's
    slice of the document): its chunks' segments, with long_docs=bucket's positions and group."""
    if not bucket_rows or (j == 0 and len(tokens) <= seq_len):  # a document of one chunk is never bucketed
        return (Segment(source, sample_id(source, ordinal, j), len(tokens), tokens, origin=origin),)
    first = j * bucket_rows
    group = sample_id(source, ordinal, first)
    return tuple(
        Segment(
            source,
            sample_id(source, ordinal, first + k),
            stop - start,
            tokens[start:stop],
            origin=origin,
            position_start=k * seq_len,
            group=group,
        )
        for k, (start, stop) in enumerate(chunk_bounds(len(tokens), seq_len))
    )


def units_of(doc: Doc, seq_len: int, bucket_rows: int = 0, rows: int = 0) -> list[Unit]:
    """A document's units (see the module's doc). A sample with images is one unit: its chunks
    stay together on one rank (at most `rows` of them), each chunk holding the images whose
    placeholders start in it. Raises ValueError for a document that cannot be placed."""
    tokens, origin = doc.tokens, doc.origin  # uint16 where the ids fit: the ring record's (formats/records.py)
    if 0 < len(tokens) <= seq_len and doc.pixels is None and doc.mask is None:  # most documents: one segment
        return [(Segment(doc.source, sample_id(doc.source, doc.ordinal, 0), len(tokens), tokens, origin=origin),)]
    count = unit_count(len(tokens), seq_len, bucket_rows, whole=doc.pixels is not None or doc.mask is not None)
    bounds = chunk_bounds(len(tokens), seq_len)
    if doc.pixels is not None and doc.image_at is not None:  # the intake sets both or neither
        ids = [sample_id(doc.source, doc.ordinal, chunk) for chunk in range(len(bounds))]
        return [_with_images(doc, tokens, doc.image_at, doc.pixels, bounds, ids, seq_len, rows)]
    if doc.mask is not None:  # a conversation: the worker made it fit one row (--long-chats)
        if len(bounds) > 1:
            raise ValueError(f"a conversation of {len(tokens)} tokens is longer than --seq-len {seq_len}")
        first = sample_id(doc.source, doc.ordinal, 0)
        return [(Segment(doc.source, first, len(tokens), tokens, origin=origin, mask=doc.mask),)]
    spans = (unit_span(len(tokens), seq_len, bucket_rows, j) for j in range(count))
    return [
        chunk_unit(doc.source, doc.ordinal, origin, tokens[start:stop], j, seq_len, bucket_rows)
        for j, (start, stop) in enumerate(spans)
    ]


def _with_images(
    doc: Doc,
    tokens: np.ndarray,
    image_at: np.ndarray,
    pixels: np.ndarray,
    bounds: list[tuple[int, int]],
    ids: list[int],
    seq_len: int,
    rows: int,
) -> Unit:
    """A sample with images as one unit. Its images must reach the rank that has their
    placeholders, so a sample longer than a row is kept whole like long_docs=bucket: whole
    rows of one rank, positions running on."""
    if len(bounds) == 1:
        return (Segment(doc.source, ids[0], len(tokens), tokens, origin=doc.origin, images=pixels),)
    if rows and len(bounds) > rows:
        raise ValueError(
            f"a sample with images of {len(tokens)} tokens needs {len(bounds)} rows of --seq-len "
            f"{seq_len} on one rank, more than --rows {rows}: raise --rows or --seq-len, or drop "
            "such samples with --long-docs drop"
        )
    # image_at is increasing: each chunk's images are a slice (a view, not a copy of the pixels)
    cuts = np.searchsorted(image_at, [start for start, _ in bounds] + [len(tokens)])
    return tuple(
        Segment(
            doc.source,
            i,
            stop - start,
            tokens[start:stop],
            origin=doc.origin,
            position_start=start,
            group=ids[0],
            images=pixels[cuts[chunk] : cuts[chunk + 1]] if cuts[chunk] < cuts[chunk + 1] else None,
        )
        for chunk, (i, (start, stop)) in enumerate(zip(ids, bounds))
    )
