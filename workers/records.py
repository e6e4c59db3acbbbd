"""The record format on a worker's ring: a 32-byte header and a payload.

DOC carries one document's tokens (int32). SKIP says the row at this position could not be
read and is skipped (on_bad_file=skip; the message rides on a file's first skipped row only).
ERROR carries a UTF-8 message: the source cannot go on. `group` and `pos` are the sample's
place in the source's deterministic order (see omniload.order).
"""
from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import numpy as np

_HEAD = struct.Struct("<QQIII4x")  # group, ordinal, pos, count, kind


class RecordKind(enum.IntEnum):
    DOC = 0
    SKIP = 1
    ERROR = 2


class Record(NamedTuple):
    kind: RecordKind
    group: int
    pos: int
    ordinal: int
    count: int
    payload: memoryview


def doc_record(group: int, pos: int, ordinal: int, tokens: np.ndarray) -> tuple[bytes, memoryview]:
    return _HEAD.pack(group, ordinal, pos, len(tokens), RecordKind.DOC), memoryview(tokens)


def skip_record(group: int, pos: int, message: str) -> tuple[bytes, bytes]:
    return _HEAD.pack(group, 0, pos, 1, RecordKind.SKIP), message.encode()


def error_record(group: int, pos: int, message: str) -> tuple[bytes, bytes]:
    return _HEAD.pack(group, 0, pos, 0, RecordKind.ERROR), message.encode()


def decode(data: bytes) -> Record:
    group, ordinal, pos, count, kind = _HEAD.unpack_from(data)
    return Record(RecordKind(kind), group, pos, ordinal, count, memoryview(data)[_HEAD.size :])


def tokens_of(record: Record) -> np.ndarray:
    return np.frombuffer(record.payload, dtype=np.int32)
