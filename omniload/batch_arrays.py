"""A rank's batch on the wire, and the batch schema a rank makes of it; pure numpy.

The schema (README "Batch schema") spends 24 bytes a token on three int64 arrays, two of
which follow from the token ids and the segment boundaries. On the wire a batch is

    input_ids       int32 [rows, seq_len]
    cu_seqlens      int32 [segments + 1]
    source          int32 [segments]      -1: padding
    sample_id       int64 [segments]
    position_start  int32 [segments]      only when a segment's positions do not start at 0
                                          (long_docs=bucket continues a document's positions)
    pixel_values    uint8 [images, 3, H, W]   only in a job with image sources; as in the schema
    image_index     int64 [images]            the segment each image belongs to
    label_mask      uint8 [rows*seq_len/8]    only in a job with conversations trained on their
                                              replies: a bit per token (np.packbits), 1 where the
                                              token is a target the loss counts

about 4 bytes a token, and `expand` makes the schema of it on the rank. The coordinator's
`build_batch` is `expand` of the same arrays, so both ends share one definition of labels and
positions. With context parallelism a rank gets slices of the rows, whose labels and
positions need the whole row: those frames carry all three arrays, as int32 (`narrow`), and
the rank widens them (`widen`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

IGNORE_INDEX = -100
PAD_ID = 0
SCHEMA_INT64 = ("input_ids", "labels", "position_ids", "source", "sample_id")  # int64 in the schema
PASSED = ("pixel_values", "image_index")  # arrays that travel as the schema has them
_BETWEEN = np.array([-1], dtype=np.int32)

Allocate = Callable[[tuple[int, ...], np.dtype], np.ndarray]


def expand(wire: dict[str, np.ndarray], empty: Allocate = np.empty) -> dict[str, np.ndarray]:
    """The schema's arrays from the compact ones; `empty` allocates the derived arrays (the
    rank passes page-locked memory with pin_memory)."""
    ids = wire["input_ids"]
    rows, seq_len = ids.shape
    cu = wire["cu_seqlens"].astype(np.int64)
    segment = np.repeat(np.arange(len(cu) - 1), np.diff(cu))  # the segment of every token
    input_ids = empty((rows, seq_len), np.dtype(np.int64))
    input_ids[...] = ids
    positions = empty((rows, seq_len), np.dtype(np.int64))
    flat = positions.reshape(-1)
    np.subtract(np.arange(rows * seq_len), cu[:-1][segment], out=flat)
    if "position_start" in wire:
        flat += wire["position_start"][segment]
    labels = empty((rows, seq_len), np.dtype(np.int64))
    following = labels.reshape(-1)
    following[:-1] = input_ids.reshape(-1)[1:]  # the next token ...
    following[cu[1:] - 1] = IGNORE_INDEX  # ... within the same segment
    following[(wire["source"] < 0)[segment]] = IGNORE_INDEX  # and none on padding
    if "label_mask" in wire:  # ... and, in a conversation, only where the next token is a reply's
        trained = np.unpackbits(wire["label_mask"], count=rows * seq_len).view(bool)
        following[:-1][~trained[1:]] = IGNORE_INDEX
    source = empty(wire["source"].shape, np.dtype(np.int64))
    source[...] = wire["source"]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": positions,
        "cu_seqlens": wire["cu_seqlens"],
        "source": source,
        "sample_id": wire["sample_id"],
        **{name: wire[name] for name in PASSED if name in wire},
    }


def trained_tokens(batches: Sequence[dict[str, np.ndarray]]) -> int:
    """The tokens of a step's batches that have a label (labels != IGNORE_INDEX once expanded):
    every real segment's tokens but its last, as `expand` labels them, and in a batch with a
    label mask only those whose next token is trained. One vectorized pass over the unmasked
    batches, not one per batch: a step at dp=1024 has 1024 of them."""
    masked = [b for b in batches if "label_mask" in b]
    if masked:
        plain = [b for b in batches if "label_mask" not in b]
        return trained_tokens(plain) + sum(_masked_trained_tokens(b) for b in masked)
    if not batches:
        return 0
    bounds = np.concatenate([b["cu_seqlens"] for b in batches]).astype(np.int64)
    # each batch's sources, then a -1 under the step from its last bound to the next batch's 0
    sources = np.concatenate([part for b in batches for part in (b["source"], _BETWEEN)])[:-1]
    lengths = np.diff(bounds)[sources >= 0]
    return int(np.maximum(lengths - 1, 0).sum())


def _masked_trained_tokens(wire: dict[str, np.ndarray]) -> int:
    """trained_tokens of one batch with a label mask: the positions `expand` gives a label."""
    size = wire["input_ids"].size
    cu = wire["cu_seqlens"].astype(np.int64)
    labelled = np.repeat(wire["source"] >= 0, np.diff(cu))  # real tokens ...
    labelled[cu[1:] - 1] = False  # ... but each segment's last ...
    trained = np.unpackbits(wire["label_mask"], count=size).view(bool)
    labelled[:-1] &= trained[1:]  # ... whose next token is a trained one
    return int(labelled.sum())


def narrow(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The schema's int64 token-sized arrays as int32, for the wire (ids, labels and positions fit)."""
    return {
        name: a.astype(np.int32) if name in SCHEMA_INT64 and name != "sample_id" else a for name, a in arrays.items()
    }


def widen(arrays: dict[str, np.ndarray], empty: Allocate = np.empty) -> dict[str, np.ndarray]:
    """Back to the schema's dtypes after `narrow`."""
    out = dict(arrays)
    for name, a in arrays.items():
        if name in SCHEMA_INT64 and a.dtype != np.int64:
            out[name] = empty(a.shape, np.dtype(np.int64))
            out[name][...] = a
    return out
