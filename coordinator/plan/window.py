"""Each source's shuffle window: its segments drawn in a deterministic shuffled order; pure.

A source's documents, in their deterministic order, are cut into units (a unit is one
segment: a document or one row-sized chunk of a longer one; with long_docs=bucket, a run of
chunks kept together). Units are gathered into blocks of at least the window size, a
document's units always in one block, and long enough that a document's tokens come at no
more than half the cap's rate (see block_tokens_for). Each block is drawn in an order seeded by (seed, source,
block start): every document
gets a random phase u and its c units a random order, the j-th of them the key (j + u) / c, so
a document's units are evenly spaced over the whole block (one unit: a uniform key) and a long
document reaches many steps a little at a time instead of filling consecutive ones. The
units' order within a document is random too: in order, the first part of every block would
hold documents' beginnings (licence headers, imports) and its last part their ends.

A draw also passes over a unit whose document already holds its share of the step (`cap`
tokens over all ranks) when another unit is within reach; a passed-over unit is drawn first
in a later step. The planner keeps each rank's share (planner.plan_step's doc_cap).

A block's position is `[start group, start pos, head, taken]`: `start` is the cursor of its
first document and its end is the intake's cursor, so a restore re-reads from start to the
cursor and rebuilds the same block; units before `head` are drawn, and `taken` lists the
units at or after `head` drawn out of turn (by the cap). A few ints, never tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniload.coordinator.plan.packer import DocKey, Segment, chunk_bounds, doc_key
from omniload.coordinator.pool.intake import Doc
from omniload.order import MAX_CHUNKS, sample_id

Unit = tuple[Segment, ...]

_SCAN = 64  # units looked at past the head for one whose document is under its cap


@dataclass(slots=True)
class Block:
    start: tuple[int, int]
    units: list[Unit]  # in draw order
    head: int = 0
    taken: set[int] = field(default_factory=set)

    @property
    def exhausted(self) -> bool:
        return self.head >= len(self.units)

    def draw(self, step_tokens: dict[DocKey, int], cap: int) -> Unit:
        """The next unit whose document stays within `cap` tokens of this step (or has none in
        it yet); the head's unit when none within reach does. The block must not be exhausted."""
        chosen = self.head
        if not fits(self.units[chosen], step_tokens, cap):  # (most draws take the head)
            looked = 1
            for i in range(self.head + 1, len(self.units)):
                if looked >= _SCAN:
                    break
                if i in self.taken:
                    continue
                if fits(self.units[i], step_tokens, cap):
                    chosen = i
                    break
                looked += 1
        if chosen == self.head:
            self.head += 1
        else:
            self.taken.add(chosen)
        while self.head in self.taken:
            self.taken.remove(self.head)
            self.head += 1
        return self.units[chosen]

    def position(self) -> list[Any]:
        return [*self.start, self.head, sorted(self.taken)]


def make_block(start: tuple[int, int], units: Sequence[Unit], seed: int, source: int) -> Block:
    """A block of `units` (in the source's order), to be drawn in its seeded permutation."""
    n = len(units)
    new_doc = np.ones(n, dtype=bool)
    origins = [unit[0].origin for unit in units]  # one source's: its documents' (group, pos) tell them apart
    new_doc[1:] = [a != b for a, b in zip(origins, origins[1:])]
    doc = np.cumsum(new_doc) - 1
    first = np.flatnonzero(new_doc)
    count = np.diff(np.append(first, n))
    rng = np.random.default_rng([seed, source, *start, 0xB10C])
    phase, shuffle = rng.random(len(first)), rng.random(n)
    by_doc = np.lexsort((shuffle, doc))  # each document's units in a random order...
    turn = np.empty(n, dtype=np.int64)
    turn[by_doc] = np.arange(n) - first[doc[by_doc]]
    keys = (turn + phase[doc]) / count[doc]  # ...and evenly spaced over the block
    order = np.argsort(keys, kind="stable")
    return Block((start[0], start[1]), [units[i] for i in order.tolist()])


def restore_block(position: Sequence[Any], units: Sequence[Unit], seed: int, source: int) -> Block:
    """The block at `position` (Block.position), from the same units make_block was given."""
    group, pos, head, taken = position
    block = make_block((group, pos), units, seed, source)
    block.head, block.taken = head, set(taken)
    return block


def block_tokens_for(longest: int, max_doc_share: float) -> int:
    """The tokens a block needs so that its longest document (evenly spaced) takes at most half
    of its cap in a step: the document's tokens per step are its share of the block times the
    source's tokens per step (at most the whole step), and the cap is max_doc_share of it."""
    return int(2 * longest / max_doc_share)


def fits(unit: Unit, step_tokens: dict[DocKey, int], cap: int) -> bool:
    held = step_tokens.get(doc_key(unit[0]), 0)
    return held == 0 or held + sum(s.length for s in unit) <= cap


def units_of(doc: Doc, seq_len: int, bucket_rows: int = 0, rows: int = 0) -> list[Unit]:
    """A document's row-sized chunks, one unit each. With bucket_rows, chunks of a long document
    stay together in units of up to that many whole rows of one rank, positions running on.
    A sample with images is one unit: its chunks stay together on one rank (at most `rows` of
    them), each chunk holding the images whose placeholders start in it. Raises ValueError
    for a document that cannot be placed."""
    tokens, origin = doc.tokens, doc.origin  # uint16 where the ids fit: the ring record's (formats/records.py)
    if 0 < len(tokens) <= seq_len and doc.pixels is None and doc.mask is None:  # most documents: one segment
        return [(Segment(doc.source, sample_id(doc.source, doc.ordinal, 0), len(tokens), tokens, origin=origin),)]
    bounds = chunk_bounds(len(tokens), seq_len)
    if len(bounds) > MAX_CHUNKS:
        raise ValueError(
            f"a document of {len(tokens)} tokens makes more than {MAX_CHUNKS} chunks of --seq-len {seq_len}"
        )
    ids = [sample_id(doc.source, doc.ordinal, chunk) for chunk in range(len(bounds))]
    if doc.pixels is not None and doc.image_at is not None:  # the intake sets both or neither
        return [_with_images(doc, tokens, doc.image_at, doc.pixels, bounds, ids, seq_len, rows)]
    if doc.mask is not None:  # a conversation: the worker made it fit one row (--long-chats)
        if len(bounds) > 1:
            raise ValueError(f"a conversation of {len(tokens)} tokens is longer than --seq-len {seq_len}")
        return [(Segment(doc.source, ids[0], len(tokens), tokens, origin=origin, mask=doc.mask),)]
    if not bucket_rows or len(bounds) < 2:
        return [
            (Segment(doc.source, i, stop - start, tokens[start:stop], origin=origin),)
            for i, (start, stop) in zip(ids, bounds)
        ]
    segments = [
        Segment(
            doc.source,
            i,
            stop - start,
            tokens[start:stop],
            origin=origin,
            position_start=(chunk % bucket_rows) * seq_len,
            group=ids[chunk - chunk % bucket_rows],
        )
        for chunk, (i, (start, stop)) in enumerate(zip(ids, bounds))
    ]
    return [tuple(segments[first : first + bucket_rows]) for first in range(0, len(segments), bucket_rows)]


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
