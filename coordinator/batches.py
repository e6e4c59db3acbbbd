"""Encode a rank's arrays as one BATCH frame: layout in the header, raw bytes in the payload."""
from __future__ import annotations

from typing import Any

import numpy as np

from omniload.protocol import Kind, encode_parts


def encode_batch(step: int, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> tuple[bytes, bytes]:
    tensors = []
    parts = []
    offset = 0
    for name, array in arrays.items():
        data = np.ascontiguousarray(array)
        tensors.append({"name": name, "dtype": str(data.dtype), "shape": list(data.shape), "offset": offset})
        pad = -data.nbytes % 8  # keep every tensor 8-byte aligned in the receive buffer
        parts += [memoryview(data).cast("B"), bytes(pad)]
        offset += data.nbytes + pad
    # join copies each array once into the payload; the frame is then shared by every rank it goes to
    return encode_parts(Kind.BATCH, {"step": step, "tensors": tensors, **meta}, b"".join(parts))
