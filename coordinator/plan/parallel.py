"""What each rank of a data-parallel replica receives: context-parallel slices; pure.

With cp > 1 every row is cut into 2*cp equal chunks and cp rank i takes chunks i and
2*cp-1-i (the load-balanced split for causal attention: an early, cheap chunk with a late,
expensive one). input_ids, labels and position_ids are sliced the same way, so labels and
positions stay those of the full row. cu_seqlens, source and sample_id describe the full rows.
"""

from __future__ import annotations

import numpy as np

SLICED = ("input_ids", "labels", "position_ids")


def cp_slice(arrays: dict[str, np.ndarray], cp: int, cp_rank: int) -> dict[str, np.ndarray]:
    if cp == 1:
        return arrays
    out = dict(arrays)
    for name in SLICED:
        rows, seq_len = arrays[name].shape
        chunks = arrays[name].reshape(rows, 2 * cp, seq_len // (2 * cp))
        out[name] = np.concatenate([chunks[:, cp_rank], chunks[:, 2 * cp - 1 - cp_rank]], axis=1)
    return out


def cp_unslice(slices: list[np.ndarray]) -> np.ndarray:
    """Reassemble the rows from every cp rank's slice (the inverse of cp_slice)."""
    cp = len(slices)
    rows, width = slices[0].shape
    half = width // 2
    chunks: list[np.ndarray] = [slices[0]] * (2 * cp)  # every one replaced below
    for i, piece in enumerate(slices):
        chunks[i], chunks[2 * cp - 1 - i] = piece[:, :half], piece[:, half:]
    return np.concatenate(chunks, axis=1)
