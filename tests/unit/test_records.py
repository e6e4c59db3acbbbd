"""The ring's record format alone: what a worker writes is what the planner reads."""

from __future__ import annotations

import numpy as np
import pytest

from omniload.formats.records import (
    RecordFlag,
    RecordKind,
    chat_record,
    decode,
    doc_record,
    images_of,
    mask_of,
    tokens_of,
)


def _roundtrip(parts: tuple) -> object:
    return decode(b"".join(bytes(part) for part in parts))


@pytest.mark.parametrize(
    "ids, small",
    [
        ([0, 5, 0xFFFF], True),  # every id fits: half the ring's bytes
        ([0, 0x10000], False),  # a 17-bit id keeps int32
        ([3, -1], False),  # so does a negative one (a transform's bug, passed on as it is)
        ([], False),
    ],
)
def test_a_document_reads_back_its_ids_in_uint16_exactly_when_every_id_fits(ids, small):
    record = _roundtrip(doc_record(7, 8, 9, np.array(ids, dtype=np.int32)))
    assert (record.kind, record.group, record.pos, record.ordinal) == (RecordKind.DOC, 7, 8, 9)
    assert tokens_of(record).tolist() == ids
    assert bool(record.flags & RecordFlag.UINT16) == small
    assert tokens_of(record).dtype == (np.uint16 if small else np.int32)


@pytest.mark.parametrize("top, small", [(0xFFFF, True), (0x10000, False)])
def test_a_conversation_reads_back_its_ids_and_its_mask_in_either_width(top, small):
    ids, mask = np.array([1, 2, top], np.int32), np.array([0, 1, 1], np.uint8)
    record = _roundtrip(chat_record(1, 2, 3, ids, mask, truncated=True))
    assert tokens_of(record).tolist() == [1, 2, top] and mask_of(record).tolist() == [0, 1, 1]
    assert record.flags & RecordFlag.TRUNCATED and bool(record.flags & RecordFlag.UINT16) == small


@pytest.mark.parametrize("top, small", [(0xFFFF, True), (0x10000, False)])
def test_a_sample_with_images_reads_back_its_ids_placeholders_and_pixels_in_either_width(top, small):
    ids, at = np.array([7, top, 7, 9, 9], np.int32), np.array([0, 2], np.int32)
    pixels = np.arange(2 * 3 * 2 * 2, dtype=np.uint8).reshape(2, 3, 2, 2)
    record = _roundtrip(doc_record(1, 2, 3, ids, at, pixels))
    assert tokens_of(record).tolist() == ids.tolist() and bool(record.flags & RecordFlag.UINT16) == small
    got_at, got_pixels = images_of(record, 2, 2)
    assert got_at.tolist() == [0, 2] and np.array_equal(got_pixels, pixels)
