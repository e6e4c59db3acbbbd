"""A source's lanes take turns within a group: together they produce exactly the one-lane
records, in order, and no lane transforms a row that another lane produces."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from omniload.formats.records import decode, tokens_of
from omniload.order import TURN
from omniload.workers import worker
from omniload.workers.readers import index_file
from tests import transforms_for_tests
from tests.corpus import write_jsonl, write_parquet


def _records(lane: worker.LaneConfig) -> list[tuple[int, int, int, list[int]]]:
    out = []
    for parts in worker._produce(lane):
        record = decode(b"".join(bytes(p) for p in parts))
        out.append((record.group, record.pos, record.ordinal, tokens_of(record).tolist()))
    return out


def _lane(shards: tuple, interleave: int, lane: int = 0, num_lanes: int = 1) -> worker.LaneConfig:
    """A lane of source 'web' over `shards` whose transform records every value it sees."""
    return worker.LaneConfig(
        source_index=0,
        source_name="web",
        column="text",
        tokenizer="tests.transforms_for_tests:counted_bytes",
        lane=lane,
        num_lanes=num_lanes,
        ring_path="",
        shards=shards,
        seed=3,
        epochs=1,
        interleave=interleave,
        start_group=0,
        start_pos=0,
        skip_bad_files=False,
    )


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "jsonl.gz"])
def test_lanes_together_produce_the_one_lane_records_each_row_transformed_once(tmp_path, fmt):
    texts = [f"doc {i} " + "x" * (i % 37) for i in range(3 * TURN + 50)]
    if fmt == "parquet":  # row groups of 200 rows, slices of 40: turns start part-way into slices
        path = write_parquet(tmp_path / "a.parquet", texts, row_group_size=200)
    else:  # a gzipped file is one shard, read on rather than entered part-way
        path = write_jsonl(tmp_path / f"a.{fmt}", texts)
    found = index_file(str(path), fmt.removesuffix(".gz"), "text", 0)
    shards = tuple(dataclasses.replace(s, slice_rows=40) for s in found)
    base = _lane(shards, interleave=2)
    transforms_for_tests.TRANSFORMED.clear()
    one = _records(base)
    assert sorted(r[2] for r in one) == list(range(len(texts)))
    # each record holds its own row's tokens: a wrong index into a slice would pair them wrongly
    assert all(tokens == list(texts[ordinal].encode()) for _, _, ordinal, tokens in one)
    for lanes in (2, 3):
        transforms_for_tests.TRANSFORMED.clear()
        produced = [r for lane in range(lanes) for r in _records(dataclasses.replace(base, lane=lane, num_lanes=lanes))]
        assert sorted(produced) == sorted(one)
        assert sorted(transforms_for_tests.TRANSFORMED) == sorted(texts)  # each row transformed by one lane only
    # a lane restarted part-way into a turn goes on from there, and only with its own positions
    group, pos = one[TURN + 10][:2]
    restarted = _records(dataclasses.replace(base, lane=1, num_lanes=2, start_group=group, start_pos=pos))
    expected = [r for r in one if (r[0], r[1]) >= (group, pos) and (r[0] + r[1] // TURN) % 2 == 1]
    assert restarted == expected


def test_a_lane_holds_only_its_own_rows_of_a_slice(tmp_path):
    """A worker serving all 4 lanes of a source must not hold 4 copies of each slice: a lane
    keeps the rows its turns take and lets the others' go as the slice is read."""
    texts = [f"doc {i} " + "y" * 300 for i in range(400)]
    path = write_parquet(tmp_path / "a.parquet", texts, row_group_size=400)
    (shard,) = (dataclasses.replace(s, slice_rows=100) for s in index_file(str(path), "parquet", "text", 0))
    lane = _lane((shard,), interleave=1, lane=1, num_lanes=4)
    due = np.arange(0, 400, 4)  # every 4th row position: a quarter of each slice
    rows = worker._open_shard(lane, 0, 0, due)
    assert isinstance(rows, worker._ShardRows)
    held = [v for v in rows._values if v is not None]
    first = rows.order[due]
    slice_of, _ = shard.slicing.locate(first)
    mine = sorted(texts[f] for f in first[slice_of == slice_of[0]])
    assert sorted(held) == mine and 0 < len(held) < len(rows._values)
    # every row it takes is still there, in the order its turns ask for them
    assert [rows.take(int(r)) for r in due if shard.slicing.locate(int(rows.order[r]))[0] == slice_of[0]] == [
        texts[f] for f in first[slice_of == slice_of[0]]
    ]


def test_a_worker_with_many_lanes_transforms_fewer_positions_at_once_in_each(tmp_path):
    """Every lane holds its batch of texts, encodings and ids at once: a worker's lanes share
    one budget of positions, down to the first batch's size; samples with images stay small."""
    path = write_parquet(tmp_path / "a.parquet", ["x"] * 10, row_group_size=10)
    lane = _lane(tuple(index_file(str(path), "parquet", "text", 0)), interleave=1)
    rows = [worker.transform_rows(lane, held) for held in (1, 4, 8, 16, 64)]
    assert rows == [256, 256, 128, 64, 32]
    assert worker.transform_rows(dataclasses.replace(lane, images=object()), 1) == 64
