"""The shuffle window alone: every unit once, seeded order, the per-document cap, restore."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload.coordinator.plan.packer import doc_key
from omniload.coordinator.plan.window import make_block, restore_block, units_of
from omniload.coordinator.pool.intake import Doc

SEQ = 16


def _units(lengths, source=0):
    docs = [Doc(source, ordinal, np.arange(n, dtype=np.int32), 0, ordinal) for ordinal, n in enumerate(lengths)]
    return [unit for doc in docs for unit in units_of(doc, SEQ)]


def _ids(units):
    return [s.sample_id for unit in units for s in unit]


def _drain(block, per_step, cap):
    """Draw in steps of `per_step` units with the cap; returns the steps' units."""
    steps = []
    while not block.exhausted:
        in_step, drawn = {}, []
        for _ in range(per_step):
            if block.exhausted:
                break
            unit = block.draw(in_step, cap)
            in_step[doc_key(unit[0])] = in_step.get(doc_key(unit[0]), 0) + sum(s.length for s in unit)
            drawn.append(unit)
        steps.append(drawn)
    return steps


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12 * SEQ), min_size=1, max_size=40),
    per_step=st.integers(1, 9),
    cap=st.integers(1, 4 * SEQ),
    seed=st.integers(0, 3),
)
def test_every_unit_is_drawn_exactly_once_whatever_the_cap(lengths, per_step, cap, seed):
    units = _units(lengths)
    steps = _drain(make_block((0, 0), units, seed, 0), per_step, cap)
    drawn = [u for step in steps for u in step]
    assert sorted(_ids(drawn)) == sorted(_ids(units))


def test_the_order_is_seeded_by_seed_source_and_start():
    units = _units([40, 3, 200, 7, 16, 90])
    order = _ids(make_block((0, 0), units, 1, 0).units)
    assert order == _ids(make_block((0, 0), units, 1, 0).units)
    assert order != _ids(make_block((0, 0), units, 2, 0).units)
    assert order != _ids(make_block((3, 5), units, 1, 0).units)


def test_a_long_documents_chunks_are_spread_and_capped_per_step():
    # one document of 60 chunks among 900 short documents, 12 units a step: 80 steps
    units = _units([60 * SEQ] + [5] * 900)
    steps = _drain(make_block((0, 0), units, 0, 0), 12, cap=SEQ)
    long_per_step = [sum(1 for u in step if u[0].origin == (0, 0)) for step in steps]
    assert max(long_per_step) == 1  # the cap: one chunk of it a step
    assert sum(long_per_step) == 60
    gaps = np.diff(np.flatnonzero(long_per_step))
    assert gaps.max() <= 3  # spread evenly over the block, not bunched


def test_when_only_one_document_is_left_the_cap_gives_way():
    steps = _drain(make_block((0, 0), _units([10 * SEQ]), 0, 0), 4, cap=SEQ)
    assert [len(step) for step in steps] == [4, 4, 2]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 8 * SEQ), min_size=2, max_size=30),
    stop=st.integers(0, 60),
    cap=st.integers(1, 3 * SEQ),
)
def test_a_restored_block_draws_what_the_original_would(lengths, stop, cap):
    units = _units(lengths)
    block = make_block((2, 7), units, 5, 1)
    in_step: dict = {}
    for _ in range(min(stop, len(units) - 1)):
        unit = block.draw(in_step, cap)
        in_step[doc_key(unit[0])] = in_step.get(doc_key(unit[0]), 0) + unit[0].length
    position = block.position()
    assert all(isinstance(x, int) for x in position[:3]) and all(isinstance(x, int) for x in position[3])
    twin = restore_block(position, units, 5, 1)
    assert _drain_from(block, dict(in_step), cap) == _drain_from(twin, dict(in_step), cap)


def _drain_from(block, in_step, cap):
    """Every remaining draw, the step's document shares accumulating as in the stepper."""
    drawn = []
    while not block.exhausted:
        unit = block.draw(in_step, cap)
        in_step[doc_key(unit[0])] = in_step.get(doc_key(unit[0]), 0) + sum(s.length for s in unit)
        drawn.append(_ids([unit]))
    return drawn


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
