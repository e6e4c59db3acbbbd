"""The record format on a worker's ring: a 32-byte header and a payload.

DOC carries one document's tokens (int32). SKIP says rows [row, row + count) of shard `g`
could not be read and are skipped (on_bad_file=skip). ERROR carries a UTF-8 message: the
source cannot go on. `g` and `row` are the sample's place in the source's deterministic order.
"""
from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import numpy as np

_HEAD = struct.Struct("<QQIII4x")  # g, ordinal, row, count, kind


class RecordKind(enum.IntEnum):
    DOC = 0
    SKIP = 1
    ERROR = 2


class Record(NamedTuple):
    kind: RecordKind
    g: int
    row: int
    ordinal: int
    count: int
    payload: memoryview


def doc_record(g: int, row: int, ordinal: int, tokens: np.ndarray) -> tuple[bytes, memoryview]:
    return _HEAD.pack(g, ordinal, row, len(tokens), RecordKind.DOC), memoryview(tokens)


def skip_record(g: int, row: int, count: int, message: str) -> tuple[bytes, bytes]:
    return _HEAD.pack(g, 0, row, count, RecordKind.SKIP), message.encode()


def error_record(g: int, row: int, message: str) -> tuple[bytes, bytes]:
    return _HEAD.pack(g, 0, row, 0, RecordKind.ERROR), message.encode()


def decode(data: bytes) -> Record:
    g, ordinal, row, count, kind = _HEAD.unpack_from(data)
    return Record(RecordKind(kind), g, row, ordinal, count, memoryview(data)[_HEAD.size :])


def tokens_of(record: Record) -> np.ndarray:
    return np.frombuffer(record.payload, dtype=np.int32)
