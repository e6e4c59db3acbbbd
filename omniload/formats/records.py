"""The record format on a worker's ring: a 32-byte header and a payload.

DOC carries one document's tokens and, for a sample with images, where each image's
placeholders start (int32 per image) and the images' pixels (uint8 [images, 3, H, W]). The
tokens are int32, or uint16 with flag UINT16 when every id fits and the record has no images:
half the ring's bytes, and the planner keeps them as they arrive (a window holds uint16 ids)
instead of checking and converting each document on its one thread. CHAT
carries a conversation's tokens (int32) and its label mask (uint8 per token, 1 where the token
is a trained target: part of an assistant reply), with flag TRUNCATED when it was cut at a turn
boundary to fit seq_len. SKIP says the row at this position could not be read and is skipped
(on_bad_file=skip; the message rides on a file's first skipped row only), or, with flag
DROPPED, that it was a conversation too long to keep. ERROR carries a UTF-8 message: the source
cannot go on; flag BAD_INPUT says the source's data is at fault (a bad file or sample: the job
exits with code 2, as for a bad file found at startup). `group` and `pos` are the sample's
place in the source's deterministic order (see omniload.order).
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import numpy as np

_HEAD = struct.Struct("<QQIIHHI")  # group, ordinal, pos, count, kind, flags, images
HEAD_SIZE = _HEAD.size  # what decode needs of a record to know its kind and place


class RecordKind(enum.IntEnum):
    DOC = 0
    SKIP = 1
    ERROR = 2
    CHAT = 3


class RecordFlag(enum.IntFlag):
    TRUNCATED = 1  # CHAT: cut at a turn boundary to fit seq_len
    DROPPED = 2  # SKIP: a conversation longer than seq_len, dropped
    BAD_INPUT = 4  # ERROR: the data is at fault, not omniload or the machine
    UINT16 = 8  # DOC without images: the tokens are uint16


class Record(NamedTuple):
    kind: RecordKind
    group: int
    pos: int
    ordinal: int
    token_count: int  # (not `count`: that would hide tuple.count)
    payload: memoryview
    images: int = 0
    flags: RecordFlag = RecordFlag(0)


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
        if len(tokens) and tokens.dtype != np.uint16 and 0 <= _bitwise_or(tokens) <= 0xFFFF:
            tokens = tokens.astype(np.uint16)  # (an OR of ids is in range exactly when each id is)
        flags = RecordFlag.UINT16 if tokens.dtype == np.uint16 else 0
        return _HEAD.pack(group, ordinal, pos, len(tokens), RecordKind.DOC, flags, 0), tokens.data
    if pixels is None:
        raise TypeError("doc_record: image_at given without pixels")
    # ndarray.data is memoryview(array); numpy declares arrays buffers to type checkers only on Python 3.12+
    return (
        _HEAD.pack(group, ordinal, pos, len(tokens), RecordKind.DOC, 0, len(image_at)),
        tokens.data,
        image_at.data,
        pixels.data.cast("B"),
    )


def chat_record(
    group: int, pos: int, ordinal: int, tokens: np.ndarray, mask: np.ndarray, truncated: bool
) -> tuple[bytes | memoryview, ...]:
    """A conversation's record: int32 tokens, then the uint8 label mask of as many entries."""
    flags = RecordFlag.TRUNCATED if truncated else 0
    return _HEAD.pack(group, ordinal, pos, len(tokens), RecordKind.CHAT, flags, 0), tokens.data, mask.data


def skip_record(group: int, pos: int, message: str, dropped: bool = False) -> tuple[bytes, bytes]:
    flags = RecordFlag.DROPPED if dropped else 0
    return _HEAD.pack(group, 0, pos, 1, RecordKind.SKIP, flags, 0), message.encode()


def error_record(group: int, pos: int, message: str, bad_input: bool = False) -> tuple[bytes, bytes]:
    flags = RecordFlag.BAD_INPUT if bad_input else 0
    return _HEAD.pack(group, 0, pos, 0, RecordKind.ERROR, flags, 0), message.encode()


def decode(data: bytes) -> Record:
    group, ordinal, pos, count, kind, flags, images = _HEAD.unpack_from(data)
    # once per document on the planner's thread: enum members looked up, not constructed
    return Record(_KINDS[kind], group, pos, ordinal, count, memoryview(data)[_HEAD.size :], images, _flags(flags))


_KINDS = {int(kind): kind for kind in RecordKind}
_FLAGS = {value: RecordFlag(value) for value in range(2 * max(RecordFlag))}
_bitwise_or = np.bitwise_or.reduce
_UINT16 = int(RecordFlag.UINT16)


def _flags(value: int) -> RecordFlag:
    flags = _FLAGS.get(value)
    return flags if flags is not None else RecordFlag(value)


def tokens_of(record: Record) -> np.ndarray:
    """A DOC or CHAT record's token ids: a read-only view of its payload (int32, or uint16)."""
    dtype = np.uint16 if int(record.flags) & _UINT16 else np.int32  # (int: Flag.__and__ is Python, per document)
    return np.frombuffer(record.payload, dtype=dtype, count=record.token_count)


def mask_of(record: Record) -> np.ndarray:
    """A CHAT record's label mask (uint8 per token)."""
    return np.frombuffer(record.payload, dtype=np.uint8, count=record.token_count, offset=4 * record.token_count)


def images_of(record: Record, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(where each image's placeholders start in the tokens, pixels uint8 [images, 3, H, W])."""
    at = np.frombuffer(record.payload, dtype=np.int32, count=record.images, offset=4 * record.token_count)
    pixels = np.frombuffer(record.payload, dtype=np.uint8, offset=4 * (record.token_count + record.images))
    return at, pixels.reshape(record.images, 3, height, width)
