"""Encode a rank's arrays as one BATCH frame: layout in the header, raw bytes in the payload.

What is the same for every rank of a step (its position, weights, dp) is encoded once per step
(`step_fields`) and spliced into each rank's header, so a step's frames cost one JSON encoding
of the position, not one per rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from omniload.protocol import Kind, encode_raw


def step_fields(fields: dict[str, Any]) -> bytes:
    """The fields every rank's header of a step shares, encoded once."""
    return orjson.dumps(fields)


def encode_batch(
    step: int, arrays: dict[str, np.ndarray], fields: dict[str, Any], shared: bytes
) -> tuple[bytes, bytes]:
    tensors = []
    parts: list[bytes | memoryview] = []
    offset = 0
    for name, array in arrays.items():
        data = np.ascontiguousarray(array)
        tensors.append({"name": name, "dtype": str(data.dtype), "shape": list(data.shape), "offset": offset})
        pad = -data.nbytes % 8  # keep every tensor 8-byte aligned in the receive buffer
        parts += [data.reshape(-1).data.cast("B"), bytes(pad)]  # flat: an empty array casts too
        offset += data.nbytes + pad
    own = orjson.dumps({"step": step, "tensors": tensors, **fields})
    head = own[:-1] + b"," + shared[1:] if len(shared) > 2 else own  # two JSON objects made one
    # join copies each array once into the payload; the frame is then shared by every rank it goes to
    prefixed, payload = encode_raw(Kind.BATCH, head, b"".join(parts))
    return prefixed, bytes(payload)  # the joined bytes themselves: bytes() of bytes is no copy
