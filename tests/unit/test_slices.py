"""Workers read shards in bounded slices: the slices hold the shard's rows, the order keeps slices apart."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniload.formats.shards import MAX_SLICES, SLICE_BYTES, BadFile, detect_format, slice_rows_for
from omniload.order import Slicing, row_permutation
from omniload.workers import readers
from omniload.workers.readers import index_file, iter_slices, read_shard
from tests.corpus import documents, write_arrow, write_jsonl, write_parquet


@pytest.fixture
def files(tmp_path):
    texts = documents(400, 9, 50, 400)  # a few hundred KB: several slices per shard below
    return [
        write_parquet(tmp_path / "a.parquet", texts, row_group_size=200),
        write_jsonl(tmp_path / "b.jsonl", texts),
        write_arrow(tmp_path / "c.arrow", texts, batch_rows=200),
    ]


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
            assert slices == [[whole[r] for r in slicing.members(j)] for j in range(slicing.count)]
            assert list(iter_slices(shard, "text", 2)) == slices[2:]


@pytest.mark.parametrize("name", ["e.jsonl", "e.jsonl.gz"])
def test_a_file_shortened_after_indexing_is_named_at_the_first_slice_it_spoils(tmp_path, name):
    """A lane reads only the slices with rows of its turns: each slice is checked, not the total at the end."""
    texts = documents(300, 11, 50, 400)
    path = write_jsonl(tmp_path / name, texts)
    (shard,) = index_file(str(path), "jsonl", "text", 0)
    shard = dataclasses.replace(shard, slice_rows=100)
    write_jsonl(path, texts[:250])
    slices = iter_slices(shard, "text")
    if shard.strided:  # every slice spans the shard: the first one read is short already
        with pytest.raises(BadFile, match="slice 0 has 84 rows, the index expects 100"):
            next(slices)
    else:  # runs from the start: the third run is short
        next(slices), next(slices)
        with pytest.raises(BadFile, match="slice 2 has 50 rows, the index expects 100"):
            next(slices)


def test_a_strided_slice_spans_the_whole_shard():
    """Files are often sorted: the first slice read must not be the shard's first rows."""
    slicing = Slicing(100, 30, strided=True)
    assert slicing.count == 4
    assert list(slicing.members(1)) == list(range(1, 100, 4))
    assert list(Slicing(100, 30).members(1)) == list(range(30, 60))
    rows = np.arange(100)
    for strided in (True, False):
        one = Slicing(100, 30, strided=strided)
        j, i = one.locate(rows)
        assert all(one.members(int(a))[int(b)] == r for r, a, b in zip(rows, j, i))


@pytest.mark.parametrize("strided", [True, False])
def test_rows_are_shuffled_within_slices_and_slices_come_one_after_another(strided):
    slicing = Slicing(100, 30, strided=strided)
    order = row_permutation(100, 1, 2, 3, 4, slicing)
    assert sorted(order.tolist()) == list(range(100))
    at = 0
    for j in range(slicing.count):
        members = slicing.members(j)
        assert sorted(order[at : at + len(members)].tolist()) == list(members)
        assert (order[at : at + len(members)] != np.array(members)).any()
        at += len(members)
    assert (
        row_permutation(100, 1, 2, 3, 4) == row_permutation(100, 1, 2, 3, 4, Slicing(100, 0, strided=strided))
    ).all()


def test_the_first_slice_read_of_a_sorted_shard_reaches_across_it(tmp_path):
    """The first rows a window gets must not be one corner of a sorted file (one package, one site)."""
    texts = [f"{i:05d} " + "y" * 400 for i in range(2000)]  # sorted, ~800 KB: several slices
    path = write_parquet(tmp_path / "sorted.parquet", texts, row_group_size=2000)
    (shard,) = index_file(str(path), "parquet", "text", 0)
    assert shard.slicing.count > 1
    order = row_permutation(shard.rows, 0, 0, 0, 0, shard.slicing)
    first = order[: len(shard.slicing.members(0))]
    assert first.max() - first.min() > 0.9 * shard.rows
    first_read = next(iter_slices(shard, "text"))
    assert int(first_read[-1][:5]) - int(first_read[0][:5]) > 0.9 * shard.rows


def test_a_strided_pass_holds_about_one_chunk_not_the_row_group(tmp_path):
    """A worker holds one slice of a shard: reading slice j of a row group many slices long
    must not keep the decoded row group alive until the slice is done. (Plain-encoded: with
    a dictionary-encoded column pyarrow itself decodes the row group whole, see docs/benchmarks.md.)"""
    texts = documents(2000, 5, 400, 600)  # ~6 MB in one row group
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=2000, use_dictionary=False)
    (shard,) = index_file(str(path), "parquet", "text", 0)
    assert shard.slicing.count == MAX_SLICES
    slice_bytes = sum(len(t) for t in texts) // MAX_SLICES
    held = []
    original = readers._arrow_chunks

    def watched(*args):
        for chunk in original(*args):
            held.append(pa.total_allocated_bytes())
            yield chunk

    readers._arrow_chunks = watched
    try:
        values = readers._strided_slice(shard, ("text",), shard.slicing.count, 3)
    finally:
        readers._arrow_chunks = original
    assert values == [texts[r] for r in shard.slicing.members(3)]
    # the reader's own pages and buffers are the same all along; what the slice keeps grows
    # by its rows only, not by the chunks they came from
    assert max(held) - held[0] < 2 * slice_bytes, (max(held) - held[0], slice_bytes)
