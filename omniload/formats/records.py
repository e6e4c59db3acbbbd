"""The record format on a worker's ring: a 32-byte header and a payload.

DOC carries one document's tokens and, for a sample with images, where each image's
placeholders start (int32 per image) and the images' pixels (uint8 [images, 3, H, W]). CHAT
carries a conversation's tokens and its label mask (uint8 per token, 1 where the token
is a trained target: part of an assistant reply), with flag TRUNCATED when it was cut at a turn
boundary to fit seq_len. SKIP says the row at this position could not be read and is skipped
(on_bad_file=skip; the message rides on a file's first skipped row only), or, with flag
DROPPED, that it was a conversation too long to keep. ERROR carries a UTF-8 message: the source
cannot go on; flag BAD_INPUT says the source's data is at fault (a bad file or sample: the job
exits with code 2, as for a bad file found at startup). `group` and `pos` are the sample's
place in the source's deterministic order (see omniload.order).

Token ids (DOC and CHAT) are uint16, with flag UINT16, when every id of the record fits, else
int32: half the ring's bytes, and the planner's windows keep the ids as they arrive, with no
check or copy of each document on its one thread.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import numpy as np

_UINT16_VOCAB = 0x10000  # every id of a vocabulary of at most this many fits a UINT16 record
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
    UINT16 = 8  # DOC, CHAT: the tokens are uint16 (else int32)


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
    tokens, compact = _compact(tokens)
    if image_at is None or not len(image_at):
        return _HEAD.pack(group, ordinal, pos, len(tokens), RecordKind.DOC, compact, 0), tokens.data
    if pixels is None:
        raise TypeError("doc_record: image_at given without pixels")
    # ndarray.data is memoryview(array); numpy declares arrays buffers to type checkers only on Python 3.12+
    return (
        _HEAD.pack(group, ordinal, pos, len(tokens), RecordKind.DOC, compact, len(image_at)),
        tokens.data,
        image_at.data,
        pixels.data.cast("B"),
    )


def chat_record(
    group: int, pos: int, ordinal: int, tokens: np.ndarray, mask: np.ndarray, truncated: bool
) -> tuple[bytes | memoryview, ...]:
    """A conversation's record: its tokens, then the uint8 label mask of as many entries."""
    tokens, compact = _compact(tokens)
    flags = compact | (RecordFlag.TRUNCATED if truncated else 0)
    return _HEAD.pack(group, ordinal, pos, len(tokens), RecordKind.CHAT, flags, 0), tokens.data, mask.data


def _compact(tokens: np.ndarray) -> tuple[np.ndarray, RecordFlag]:
    """The int32 ids as uint16 when every one fits (the bitwise OR of ids is in range exactly
    when each id is: a negative one sets the sign bit), with the flag that says so."""
    if tokens.dtype != np.uint16 and len(tokens) and 0 <= _bitwise_or(tokens) <= 0xFFFF:
        tokens = tokens.astype(np.uint16)
    return tokens, RecordFlag.UINT16 if tokens.dtype == np.uint16 else RecordFlag(0)


def skip_record(group: int, pos: int, message: str, dropped: bool = False) -> tuple[bytes, bytes]:
    flags = RecordFlag.DROPPED if dropped else 0
    return _HEAD.pack(group, 0, pos, 1, RecordKind.SKIP, flags, 0), message.encode()


def error_record(group: int, pos: int, message: str, bad_input: bool = False) -> tuple[bytes, bytes]:
    flags = RecordFlag.BAD_INPUT if bad_input else 0
    return _HEAD.pack(group, 0, pos, 0, RecordKind.ERROR, flags, 0), message.encode()


def ids_fit_uint16(dtype: np.dtype | str | None = None, vocab: int | None = None) -> bool:
    """Whether every id must fit a UINT16 record before any is seen: ids of an unsigned type of
    at most 16 bits, or (checked) below a vocabulary of at most _UINT16_VOCAB. Decides where ids
    are made uint16 from the start (tokenizers, token files) and what a ring's read-ahead is
    sized for; a record whose ids happen to fit is UINT16 anyway (_compact)."""
    narrow = dtype is not None and np.dtype(dtype) in (np.dtype(np.uint8), np.dtype(np.uint16))
    return narrow or (vocab is not None and vocab <= _UINT16_VOCAB)


def decode(data: bytes) -> Record:
    group, ordinal, pos, count, kind, flags, images = _HEAD.unpack_from(data)
    # once per document on the planner's thread: enum members looked up, not constructed, and
    # the tuple made by tuple.__new__ (a NamedTuple's own __new__ is Python, ~130 ns more)
    fields = (_KINDS[kind], group, pos, ordinal, count, memoryview(data)[_HEAD.size :], images, _flags(flags))
    return tuple.__new__(Record, fields)


_KINDS = {int(kind): kind for kind in RecordKind}
_FLAGS = {value: RecordFlag(value) for value in range(2 * max(RecordFlag))}
_bitwise_or = np.bitwise_or.reduce
_UINT16 = int(RecordFlag.UINT16)


def _flags(value: int) -> RecordFlag:
    flags = _FLAGS.get(value)
    return flags if flags is not None else RecordFlag(value)


def tokens_of(record: Record) -> np.ndarray:
    """A DOC or CHAT record's token ids: a read-only view of its payload (uint16 or int32)."""
    return np.frombuffer(record.payload, _dtype(record), record.token_count)


def mask_of(record: Record) -> np.ndarray:
    """A CHAT record's label mask (uint8 per token)."""
    return np.frombuffer(record.payload, _UINT8, record.token_count, _tokens_nbytes(record))


def images_of(record: Record, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(where each image's placeholders start in the tokens, pixels uint8 [images, 3, H, W])."""
    after = _tokens_nbytes(record)
    at = np.frombuffer(record.payload, _INT32_IDS, record.images, after)
    pixels = np.frombuffer(record.payload, _UINT8, -1, after + 4 * record.images)
    return at, pixels.reshape(record.images, 3, height, width)


# dtype objects, not types: np.frombuffer converts a type to a dtype on every call (~300 ns a document)
_UINT16_IDS, _INT32_IDS, _UINT8 = np.dtype(np.uint16), np.dtype(np.int32), np.dtype(np.uint8)


def _dtype(record: Record) -> np.dtype:
    return _UINT16_IDS if int(record.flags) & _UINT16 else _INT32_IDS  # (int: Flag.__and__ is Python, per document)


def _tokens_nbytes(record: Record) -> int:
    return record.token_count * (2 if int(record.flags) & _UINT16 else 4)
