"""Workers read shards in bounded slices: the slices hold the shard's rows, the order keeps slices apart."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from omniload.order import Slicing, row_permutation
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


def test_slices_from_any_point_hold_the_rows_the_slicing_names(files, tmp_path):
    gz = write_jsonl(tmp_path / "d.jsonl.gz", documents(300, 10, 50, 400))
    for path in [*files, gz]:
        for shard in index_file(str(path), detect_format(str(path)), "text", 0):
            shard = dataclasses.replace(shard, slice_rows=37)
            slicing = shard.slicing
            assert slicing.strided == (path != gz)
            whole = read_shard(shard, "text")
            slices = list(iter_slices(shard, "text"))
            assert len(slices) == slicing.count == -(-shard.rows // 37)
            assert [s for s in slices] == [[whole[r] for r in slicing.members(j)] for j in range(slicing.count)]
            assert list(iter_slices(shard, "text", 2)) == slices[2:]


def test_a_strided_slice_spans_the_whole_shard():
    """Files are often sorted: the first slice read must not be the shard's first rows."""
    slicing = Slicing(100, 30, strided=True)
    assert slicing.count == 4
    assert list(slicing.members(1)) == list(range(1, 100, 4))
    assert list(Slicing(100, 30).members(1)) == list(range(30, 60))
    rows = np.arange(100)
    for strided in (True, False):
        one = Slicing(100, 30, strided)
        j, i = one.locate(rows)
        assert all(one.members(int(a))[int(b)] == r for r, a, b in zip(rows, j, i))


@pytest.mark.parametrize("strided", [True, False])
def test_rows_are_shuffled_within_slices_and_slices_come_one_after_another(strided):
    slicing = Slicing(100, 30, strided)
    order = row_permutation(100, 1, 2, 3, 4, slicing)
    assert sorted(order.tolist()) == list(range(100))
    at = 0
    for j in range(slicing.count):
        members = slicing.members(j)
        assert sorted(order[at : at + len(members)].tolist()) == list(members)
        assert (order[at : at + len(members)] != np.array(members)).any()
        at += len(members)
    assert (row_permutation(100, 1, 2, 3, 4) == row_permutation(100, 1, 2, 3, 4, Slicing(100, 0, strided))).all()
