import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload.coordinator.plan.packer import IGNORE_INDEX, Segment, build_batch, chunk_bounds


def _segments(lengths, source=0):
    return [Segment(source, i, n, np.arange(1, n + 1, dtype=np.int32) + 1000 * i) for i, n in enumerate(lengths)]


def test_chunks_cover_a_long_document_exactly():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(4, 4) == [(0, 4)]
    assert chunk_bounds(0, 4) == []


def test_batch_schema():
    segs = _segments([3, 5, 2])
    batch = build_batch([[segs[0], segs[1]], [segs[2]]], seq_len=8)
    assert {k: (v.dtype.name, v.shape) for k, v in batch.items()} == {
        "input_ids": ("int64", (2, 8)),
        "labels": ("int64", (2, 8)),
        "position_ids": ("int64", (2, 8)),
        "cu_seqlens": ("int32", (5,)),
        "source": ("int64", (4,)),
        "sample_id": ("int64", (4,)),
    }
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 10, 16]  # 3 | 5 || 2 | padding 6
    assert batch["source"].tolist() == [0, 0, 0, -1]
    assert batch["sample_id"].tolist() == [0, 1, 2, -1]
    assert batch["input_ids"].tolist() == [[1, 2, 3, 1001, 1002, 1003, 1004, 1005], [2001, 2002, 0, 0, 0, 0, 0, 0]]
    x = IGNORE_INDEX
    assert batch["labels"].tolist() == [[2, 3, x, 1002, 1003, 1004, 1005, x], [2002, x, x, x, x, x, x, x]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(1, 16), max_size=4), min_size=1, max_size=4))
def test_no_segment_crosses_a_row_and_labels_stay_inside_segments(row_lengths):
    seq_len = 64
    rows = [_segments(lengths) for lengths in row_lengths]
    batch = build_batch(rows, seq_len)
    cu = batch["cu_seqlens"]
    assert cu[0] == 0 and cu[-1] == len(rows) * seq_len
    row_starts = set(range(0, len(rows) * seq_len + 1, seq_len))
    ends = set(cu.tolist())
    assert row_starts <= ends  # every row boundary is a segment boundary
    labels, ids = batch["labels"].ravel(), batch["input_ids"].ravel()
    for start, stop, source in zip(cu[:-1], cu[1:], batch["source"]):
        assert labels[stop - 1] == IGNORE_INDEX
        if source >= 0:
            assert (labels[start : stop - 1] == ids[start + 1 : stop]).all()
        else:
            assert (labels[start:stop] == IGNORE_INDEX).all()
        assert batch["position_ids"].ravel()[start:stop].tolist() == list(range(stop - start))


def test_positions_run_on_across_the_rows_of_a_bucketed_document():
    tokens = np.arange(1, 11, dtype=np.int32)
    first = Segment(0, 0, 6, tokens[:6], group=0)
    second = Segment(0, 1, 4, tokens[6:], position_start=6, group=0)
    batch = build_batch([[first], [second]], seq_len=6)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 0, 1]]
