"""A document cut into units: row-sized chunks, bucketed runs, and one unit made on its own."""

from __future__ import annotations

import numpy as np
import pytest

from omniload.coordinator.plan.documents import Doc
from omniload.coordinator.plan.units import chunk_unit, unit_count, unit_span, units_of

SEQ = 16


def test_bucketed_chunks_stay_together_as_one_unit():
    doc = Doc(0, 3, np.arange(5 * SEQ + 3, dtype=np.int32), 0, 3)
    units = units_of(doc, SEQ, bucket_rows=2)
    assert [len(u) for u in units] == [2, 2, 2]
    assert [s.position_start for s in units[1]] == [0, SEQ]
    assert len({s.group for s in units[0]}) == 1


@pytest.mark.parametrize("length", [0, 1, SEQ, SEQ + 1, 3 * SEQ])
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_a_document_becomes_its_row_sized_chunks_with_its_ids_unchanged(length, dtype):
    """An empty document makes no unit; one of at most a row, one segment; a longer one, a
    segment per row, each a view of the document's ids in their dtype (the record's)."""
    tokens = np.arange(length, dtype=dtype)
    units = units_of(Doc(2, 7, tokens, 1, 4), SEQ)
    assert [len(u) for u in units] == [1] * -(-length // SEQ)
    segments = [s for u in units for s in u]
    assert [s.length for s in segments] == [min(SEQ, length - start) for start in range(0, length, SEQ)]
    assert all(s.origin == (1, 4) and s.source == 2 and s.tokens.dtype == dtype for s in segments)
    assert np.array_equal(np.concatenate([s.tokens for s in segments] or [tokens[:0]]), tokens)


@pytest.mark.parametrize("length", [1, SEQ, SEQ + 1, 5 * SEQ + 3, 8 * SEQ])
@pytest.mark.parametrize("bucket_rows", [0, 2, 3])
def test_a_unit_made_from_its_own_tokens_is_the_unit_units_of_makes(length, bucket_rows):
    """The spread keeps a waiting document's tokens in a store and makes a unit when it is
    drawn, from that unit's tokens alone: the same segments as cutting the whole document."""
    doc = Doc(1, 9, np.arange(length, dtype=np.uint16), 4, 2)
    whole = units_of(doc, SEQ, bucket_rows)
    assert unit_count(length, SEQ, bucket_rows) == len(whole)
    for j, unit in enumerate(whole):
        start, stop = unit_span(length, SEQ, bucket_rows, j)
        alone = chunk_unit(1, 9, (4, 2), doc.tokens[start:stop], j, SEQ, bucket_rows)
        assert [(s.sample_id, s.length, s.position_start, s.group, s.origin) for s in alone] == [
            (s.sample_id, s.length, s.position_start, s.group, s.origin) for s in unit
        ]
        assert np.array_equal(np.concatenate([s.tokens for s in alone]), np.concatenate([s.tokens for s in unit]))


def test_a_document_of_too_many_chunks_is_refused_before_it_is_cut():
    with pytest.raises(ValueError, match="more than 4096 chunks"):
        unit_count(4097 * SEQ, SEQ)
