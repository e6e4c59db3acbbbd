"""The catalog's shards in columns (formats/shard_table.py): every Shard comes back as it went
in, whatever its numbers and versions, in under 100 bytes a shard at 100,000 objects."""

from __future__ import annotations

import dataclasses
import pickle
import tracemalloc

import numpy as np
import pytest

from omniload.formats.shard_table import ShardTable, table_arrays, table_from_arrays
from omniload.formats.shards import Shard
from tests.corpus import bucket_objects


def test_every_shard_comes_back_as_it_went_in():
    shards = [
        Shard("data/a.jsonl", "jsonl", 0, 10, 10, 0, byte_offset=0),
        Shard("data/a.jsonl", "jsonl", 10, 25, 15, 10, byte_offset=4096, slice_rows=5),
        Shard("data/t.bin", "tokens", 2**33, 2**33 + 9, 3, 25),  # a token offset past int32
        Shard("s3://b/x.parquet", "parquet", 2, 3, 7, 28, size=123, version="9f86d081884c7d659a2feaa0c55ad015-3"),
        Shard("s3://b/é.parquet", "parquet", 0, 1, 1, 35, size=5, version=""),
    ]
    table = ShardTable(shards)
    assert len(table) == 5 and list(table) == shards and table == shards
    assert [table[i] for i in range(5)] == shards and table[-1] == shards[-1] and table[1:3] == shards[1:3]
    assert table.column("first_ordinal").tolist() == [0, 10, 25, 28, 35]
    assert table.files() == [  # what the job's identity records of each file
        ("data/a.jsonl", 0, "", 25),
        ("data/t.bin", 0, "", 3),
        ("s3://b/x.parquet", 123, "9f86d081884c7d659a2feaa0c55ad015-3", 7),
        ("s3://b/é.parquet", 5, "", 1),
    ]
    assert table.column("start").dtype == np.int64 and table.column("rows").dtype == np.int32
    assert pickle.loads(pickle.dumps(table)) == shards, "a worker gets the table its coordinator holds"
    with pytest.raises(IndexError):
        table[5]


def test_a_catalog_of_100000_objects_holds_under_100_bytes_an_object():
    shards = bucket_objects(100_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = ShardTable(shards)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held / len(shards) < 100, f"{held / len(shards):.0f} B an object"
    assert table.nbytes() / len(shards) < 100 and len(pickle.dumps(table)) / len(shards) < 100
    assert table[54_321] == shards[54_321] and table[99_999] == shards[99_999]


@pytest.mark.parametrize("versions", ["etags", "text"])
def test_a_kept_catalog_reads_back_the_table_it_wrote(tmp_path, versions):
    """What a restart, a standby or the next run reads instead of listing the store again
    (np.savez's file, no pickle)."""
    shards = bucket_objects(500)
    if versions == "text":  # multipart ETags, GCS generations: not 32 hex digits
        shards = [dataclasses.replace(s, version=f"{i}-{i % 3}") for i, s in enumerate(shards)]
    shards.append(Shard("s3://bucket/other/ü.jsonl", "jsonl", 0, 3, 3, 600_000, 128, 0, 9, shards[0].version))
    path = tmp_path / "catalog.npz"
    with open(path, "wb") as file:
        np.savez(file, **table_arrays(ShardTable(shards), "3/"), **table_arrays(ShardTable([]), "4/"))
    with np.load(path, allow_pickle=False) as arrays:
        assert list(table_from_arrays(arrays, "3/")) == shards
        assert len(table_from_arrays(arrays, "4/")) == 0
