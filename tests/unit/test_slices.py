"""Workers read shards in bounded slices: the slices hold the shard's rows, the order keeps slices apart."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from omniload.order import row_permutation
from omniload.workers.readers import MAX_SLICES, SLICE_BYTES, index_file, iter_slices, read_shard, slice_rows_for
from omniload.workers.shards import detect_format
from tests.corpus import documents, write_arrow, write_jsonl, write_parquet


@pytest.fixture
def files(tmp_path):
    texts = documents(400, 9, 50, 400)  # a few hundred KB: several slices per shard below
    return [write_parquet(tmp_path / "a.parquet", texts, row_group_size=200),
            write_jsonl(tmp_path / "b.jsonl", texts), write_arrow(tmp_path / "c.arrow", texts, batch_rows=200)]


def test_slice_rows_keep_a_slice_near_the_target_and_cap_the_count():
    assert slice_rows_for(1000, SLICE_BYTES // 2) == 1000  # small: the shard is one slice
    assert slice_rows_for(1000, 4 * SLICE_BYTES) == 250
    assert -(-1000 // slice_rows_for(1000, 1000 * SLICE_BYTES)) <= MAX_SLICES


def test_slices_from_any_point_hold_the_shard_in_file_order(files):
    for path in files:
        for shard in index_file(str(path), detect_format(str(path)), "text", 0):
            shard = dataclasses.replace(shard, slice_rows=37)
            whole = read_shard(shard, "text")
            slices = list(iter_slices(shard, "text"))
            assert [len(s) for s in slices[:-1]] == [37] * (len(slices) - 1)
            assert [v for s in slices for v in s] == whole
            assert [v for s in iter_slices(shard, "text", 2) for v in s] == whole[2 * 37 :]


def test_rows_are_shuffled_within_slices_and_slices_come_in_file_order():
    order = row_permutation(100, 1, 2, 3, 4, slice_rows=30)
    assert sorted(order.tolist()) == list(range(100))
    for start in range(0, 100, 30):
        assert sorted(order[start : start + 30].tolist()) == list(range(start, min(100, start + 30)))
    assert (order[:30] != np.arange(30)).any()
    assert (row_permutation(100, 1, 2, 3, 4) == row_permutation(100, 1, 2, 3, 4, slice_rows=0)).all()
