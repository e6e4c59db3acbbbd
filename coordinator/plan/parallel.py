"""What each rank of a data-parallel replica receives: context-parallel slices; pure.

Both splits are the load-balanced one for causal attention: cut into 2*cp equal chunks, cp rank
i takes chunks i and 2*cp-1-i (an early, cheap chunk with a late, expensive one). They differ in
what is cut (`--cp-split`):

- `row` (BSHD: padded rows): every row. The slices keep the rows' shape, [rows, seq_len / cp];
  cu_seqlens, source and sample_id describe the full rows.
- `sequence` (Transformer Engine's THD layout for packed documents): every sequence (segment of
  cu_seqlens), each padded first to a multiple of 2*cp. A rank's slice is its chunks of every
  sequence in order, [1, padded tokens / cp]; cu_seqlens are the real sequences' bounds and
  cu_seqlens_padded the padded ones, both of the whole sequences, as TE's attention takes them
  with cp > 1. Padding is token PAD_ID, label IGNORE_INDEX, and positions run on.

Either way input_ids, labels and position_ids are those of the whole row or sequence (a
slice's labels need its neighbours), and each split has its inverse here for the ranks (and
tests) that gather the slices back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from omniload.batch_arrays import IGNORE_INDEX, PAD_ID

SLICED = ("input_ids", "labels", "position_ids")
Arrays = dict[str, NDArray[Any]]


def cp_slice(arrays: Arrays, cp: int, cp_rank: int) -> Arrays:
    """cp rank `cp_rank`'s slice of every row (`--cp-split row`)."""
    if cp == 1:
        return arrays
    out = dict(arrays)
    for name in SLICED:
        rows, seq_len = arrays[name].shape
        chunks = arrays[name].reshape(rows, 2 * cp, seq_len // (2 * cp))
        out[name] = np.concatenate([chunks[:, cp_rank], chunks[:, 2 * cp - 1 - cp_rank]], axis=1)
    return out


def cp_unslice(slices: list[NDArray[Any]]) -> NDArray[Any]:
    """Reassemble the rows from every cp rank's slice (the inverse of cp_slice)."""
    cp = len(slices)
    rows, width = slices[0].shape
    half = width // 2
    chunks: list[NDArray[Any]] = [slices[0]] * (2 * cp)  # every one replaced below
    for i, piece in enumerate(slices):
        chunks[i], chunks[2 * cp - 1 - i] = piece[:, :half], piece[:, half:]
    return np.concatenate(chunks, axis=1)


def padded_cu_seqlens(cu_seqlens: NDArray[np.integer], multiple: int) -> NDArray[np.int64]:
    """The bounds of the sequences once each is padded up to a multiple of `multiple`."""
    lengths = np.diff(cu_seqlens.astype(np.int64))
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(-(-lengths // multiple) * multiple, out=out[1:])
    return out


def thd_indices(cu_seqlens_padded: NDArray[np.integer], cp: int, cp_rank: int) -> NDArray[np.int64]:
    """The tokens of the padded sequences that cp rank `cp_rank` takes, in its order: of every
    sequence, chunk cp_rank then chunk 2*cp-1-cp_rank of its 2*cp equal chunks."""
    bounds = cu_seqlens_padded.astype(np.int64)
    starts, chunk = bounds[:-1], np.diff(bounds) // (2 * cp)
    run_start = np.stack([starts + cp_rank * chunk, starts + (2 * cp - 1 - cp_rank) * chunk], axis=1).reshape(-1)
    run_len = np.repeat(chunk, 2)
    within = np.arange(int(run_len.sum())) - np.repeat(np.cumsum(run_len) - run_len, run_len)
    taken: NDArray[np.int64] = np.repeat(run_start, run_len) + within
    return taken


def _places(cu: NDArray[np.int64], cu_padded: NDArray[np.int64]) -> NDArray[np.int64]:
    """Where each real token sits once every sequence is padded (at its end)."""
    return np.arange(cu[-1]) - np.repeat(cu[:-1] - cu_padded[:-1], np.diff(cu))


def thd_pad(arrays: Arrays, cp: int) -> Arrays:
    """A replica's batch (the schema, omniload.batch_arrays.expand: any number of rows, one flat
    row included) with every sequence padded to a multiple of 2*cp, flat: what thd_take cuts.
    Once per replica; its cp ranks' takes are then a gather each."""
    cu = arrays["cu_seqlens"].astype(np.int64)
    cu_padded = padded_cu_seqlens(cu, 2 * cp)
    to_padded, total = _places(cu, cu_padded), int(cu_padded[-1])
    out = dict(arrays)
    for name, fill in (("input_ids", PAD_ID), ("labels", IGNORE_INDEX)):
        out[name] = np.full(total, fill, dtype=arrays[name].dtype)
        out[name][to_padded] = arrays[name].reshape(-1)
    positions = arrays["position_ids"].reshape(-1)
    first = positions[np.minimum(cu[:-1], max(len(positions) - 1, 0))] if len(positions) else cu[:-1]
    run_on = np.repeat(first - cu_padded[:-1], np.diff(cu_padded)) + np.arange(total)  # a pad's position runs on
    run_on[to_padded] = positions
    out["position_ids"] = run_on.astype(positions.dtype)
    out["cu_seqlens_padded"] = cu_padded.astype(arrays["cu_seqlens"].dtype)
    return out


def thd_take(padded: Arrays, cp: int, cp_rank: int) -> Arrays:
    """cp rank `cp_rank`'s share of every sequence of a thd_pad'ded batch: [1, padded / cp]."""
    take = thd_indices(padded["cu_seqlens_padded"], cp, cp_rank)
    return {**padded, **{name: padded[name][take].reshape(1, -1) for name in SLICED}}


def thd_slice(arrays: Arrays, cp: int, cp_rank: int) -> Arrays:
    """cp rank `cp_rank`'s share of every sequence (`--cp-split sequence`) of a replica's batch."""
    return thd_take(thd_pad(arrays, cp), cp, cp_rank)


def thd_unslice(
    slices: list[NDArray[Any]], cu_seqlens: NDArray[np.integer], cu_seqlens_padded: NDArray[np.integer]
) -> NDArray[Any]:
    """The whole sequences, flat and without their padding, from every cp rank's slice (the
    inverse of thd_slice for one of input_ids, labels, position_ids)."""
    cp = len(slices)
    padded = np.empty(int(cu_seqlens_padded[-1]), dtype=slices[0].dtype)
    for cp_rank, piece in enumerate(slices):
        padded[thd_indices(cu_seqlens_padded, cp, cp_rank)] = piece.reshape(-1)
    return padded[_places(cu_seqlens.astype(np.int64), cu_seqlens_padded.astype(np.int64))]


def _whole(arrays: Arrays, cp: int) -> Arrays:
    return arrays


class Split(NamedTuple):
    """A `--cp-split`: `prepare` a replica's batch once, then `take` each cp rank's slice of it."""

    prepare: Callable[[Arrays, int], Arrays]
    take: Callable[[Arrays, int, int], Arrays]


CP_SPLITTERS = {"sequence": Split(thd_pad, thd_take), "row": Split(_whole, cp_slice)}
