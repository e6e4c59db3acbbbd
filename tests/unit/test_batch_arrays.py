"""The compact wire: the schema a rank derives equals the schema, for any segmentation."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload.batch_arrays import IGNORE_INDEX, PAD_ID, expand, narrow, trained_tokens, widen
from omniload.coordinator.plan.packer import Segment, compact_batch

SEQ = 32


def _schema_by_the_rules(rows: list[list[Segment]], seq_len: int) -> dict[str, np.ndarray]:
    """The README's batch schema, token by token: the reference the vectorized expand must match."""
    ids, labels, positions, lengths, sources, sample_ids = [], [], [], [], [], []
    for row in rows:
        used = 0
        for s in row:
            ids += list(s.tokens)
            labels += list(s.tokens[1:]) + [IGNORE_INDEX]
            positions += [s.position_start + i for i in range(s.length)]
            lengths.append(s.length)
            sources.append(s.source)
            sample_ids.append(s.sample_id)
            used += s.length
        if seq_len - used:
            pad = seq_len - used
            ids += [PAD_ID] * pad
            labels += [IGNORE_INDEX] * pad
            positions += list(range(pad))
            lengths.append(pad)
            sources.append(-1)
            sample_ids.append(-1)
    shape = (len(rows), seq_len)
    return {
        "input_ids": np.array(ids).reshape(shape),
        "labels": np.array(labels).reshape(shape),
        "position_ids": np.array(positions).reshape(shape),
        "cu_seqlens": np.cumsum([0] + lengths),
        "source": np.array(sources),
        "sample_id": np.array(sample_ids),
    }


@st.composite
def _rows(draw):
    rows, ordinal = [], 0
    for _ in range(draw(st.integers(1, 4))):
        row, room = [], SEQ
        while room and draw(st.booleans()):
            length = draw(st.integers(1, room))
            start = draw(st.sampled_from([0, 0, SEQ, 3 * SEQ]))  # a later chunk of a bucketed document
            tokens = np.array(draw(st.lists(st.integers(0, 2**31 - 1), min_size=length, max_size=length)), np.int32)
            row.append(Segment(draw(st.integers(0, 5)), ordinal, length, tokens, position_start=start))
            ordinal += 1
            room -= length
        rows.append(row)
    return rows


@settings(max_examples=200, deadline=None)
@given(_rows())
def test_the_rank_derives_exactly_the_schema(rows):
    wire = compact_batch(rows, SEQ)
    got = expand(wire)
    want = _schema_by_the_rules(rows, SEQ)
    assert set(got) == set(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert trained_tokens([wire]) == int((want["labels"] != IGNORE_INDEX).sum())  # the loss's token count
    assert {n: a.dtype.name for n, a in got.items()} == {
        "input_ids": "int64",
        "labels": "int64",
        "position_ids": "int64",
        "cu_seqlens": "int32",
        "source": "int64",
        "sample_id": "int64",
    }


@settings(max_examples=50, deadline=None)
@given(_rows())
def test_the_wire_carries_four_bytes_a_token_plus_the_segments(rows):
    wire = compact_batch(rows, SEQ)
    segments = len(wire["sample_id"])
    assert sum(a.nbytes for a in wire.values()) <= 4 * len(rows) * SEQ + 20 * segments + 4
    assert ("position_start" in wire) == any(s.position_start for row in rows for s in row)


def test_narrowed_arrays_widen_back_unchanged():
    schema = expand(compact_batch([[Segment(1, 7, 5, np.arange(5, dtype=np.int32) + 2**30)]], SEQ))
    sent = narrow(schema)
    assert {sent[n].dtype.name for n in ("input_ids", "labels", "position_ids", "source")} == {"int32"}
    back = widen(sent)
    assert all(np.array_equal(back[n], schema[n]) and back[n].dtype == schema[n].dtype for n in schema)


@settings(max_examples=50, deadline=None)
@given(st.lists(_rows(), min_size=0, max_size=5))
def test_a_steps_trained_tokens_are_every_ranks_labels(ranks):
    """What loader.meta["global_trained_tokens"] holds: the labels of every data-parallel rank's batch."""
    wires = [compact_batch(rows, SEQ) for rows in ranks]
    assert trained_tokens(wires) == sum(int((expand(w)["labels"] != IGNORE_INDEX).sum()) for w in wires)
