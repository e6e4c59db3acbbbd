"""The record format on a worker's ring: a 32-byte header and a payload.

DOC carries one document's tokens (int32) and, for a sample with images, where each image's
placeholders start (int32 per image) and the images' pixels (uint8 [images, 3, H, W]). SKIP says the row at this
position could not be
read and is skipped (on_bad_file=skip; the message rides on a file's first skipped row only).
ERROR carries a UTF-8 message: the source cannot go on. `group` and `pos` are the sample's
place in the source's deterministic order (see omniload.order).
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import numpy as np

_HEAD = struct.Struct("<QQIIII")  # group, ordinal, pos, count, kind, images
HEAD_SIZE = _HEAD.size  # what decode needs of a record to know its kind and place


class RecordKind(enum.IntEnum):
    DOC = 0
    SKIP = 1
    ERROR = 2


class Record(NamedTuple):
    kind: RecordKind
    group: int
    pos: int
    ordinal: int
    token_count: int  # (not `count`: that would hide tuple.count)
    payload: memoryview
    images: int = 0


def doc_record(
    group: int,
    pos: int,
    ordinal: int,
    tokens: np.ndarray,
    image_at: np.ndarray | None = None,
    pixels: np.ndarray | None = None,
) -> tuple[bytes | memoryview, ...]:
    """The record's parts; the first payload part is always the tokens (the worker counts them)."""
    if image_at is None or not len(image_at):
        return _HEAD.pack(group, ordinal, pos, len(tokens), RecordKind.DOC, 0), tokens.data
    if pixels is None:
        raise TypeError("doc_record: image_at given without pixels")
    # ndarray.data is memoryview(array); numpy declares arrays buffers to type checkers only on Python 3.12+
    return (
        _HEAD.pack(group, ordinal, pos, len(tokens), RecordKind.DOC, len(image_at)),
        tokens.data,
        image_at.data,
        pixels.data.cast("B"),
    )


def skip_record(group: int, pos: int, message: str) -> tuple[bytes, bytes]:
    return _HEAD.pack(group, 0, pos, 1, RecordKind.SKIP, 0), message.encode()


def error_record(group: int, pos: int, message: str) -> tuple[bytes, bytes]:
    return _HEAD.pack(group, 0, pos, 0, RecordKind.ERROR, 0), message.encode()


def decode(data: bytes) -> Record:
    group, ordinal, pos, count, kind, images = _HEAD.unpack_from(data)
    return Record(RecordKind(kind), group, pos, ordinal, count, memoryview(data)[_HEAD.size :], images)


def tokens_of(record: Record) -> np.ndarray:
    return np.frombuffer(record.payload, dtype=np.int32, count=record.token_count)


def images_of(record: Record, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(where each image's placeholders start in the tokens, pixels uint8 [images, 3, H, W])."""
    at = np.frombuffer(record.payload, dtype=np.int32, count=record.images, offset=4 * record.token_count)
    pixels = np.frombuffer(record.payload, dtype=np.uint8, offset=4 * (record.token_count + record.images))
    return at, pixels.reshape(record.images, 3, height, width)
