"""Pre-tokenized files (workers/token_files.py): Megatron indexed datasets and flat token files,
read back to exactly the documents written, and bad files named with what is wrong and where."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from omniload.formats.lane_config import Pretokenized
from omniload.formats.shards import BadFile, detect_format
from omniload.workers import token_files
from omniload.workers.readers import LOCAL, index_file, read_shard
from tests.corpus import write_megatron, write_token_file


def _docs(n: int, seed: int, high: int = 50000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, int(rng.integers(0, 40))).tolist() for _ in range(n)]


def _read_all(path, fmt: str, layout: Pretokenized | None = None) -> list[list[int]]:
    shards = index_file(str(path), fmt, "text", 0, pretokenized=layout)
    assert [s.first_ordinal for s in shards] == list(np.cumsum([0] + [s.rows for s in shards[:-1]]))
    return [v.tolist() for shard in shards for v in read_shard(shard, "text", pretokenized=layout)]


def test_megatron_documents_read_back_as_written_including_multi_sequence_ones(tmp_path):
    docs = _docs(300, seed=1)
    # document 5 was split into sentences: three sequences, one document
    nested = [[d] for d in docs]
    nested[5] = [[1, 2, 3], [], [4, 5]]
    bin_path = write_megatron(tmp_path / "corpus_text_document", nested)
    assert detect_format(str(bin_path)) == "megatron"
    got = _read_all(bin_path, "megatron")
    assert got == [sum(d, []) for d in nested]


def test_megatron_shards_split_a_large_file_and_every_slice_is_read_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(token_files, "SHARD_TOKENS", 200)
    docs = _docs(100, seed=2)
    bin_path = write_megatron(tmp_path / "d", [[d] for d in docs], dtype=np.int32)
    shards = index_file(str(bin_path), "megatron", "text", 7)
    assert len(shards) > 3 and sum(s.rows for s in shards) == 100 and shards[0].first_ordinal == 7
    shard = shards[1]
    sliced = dataclasses.replace(shard, slice_rows=3)
    rows = token_files.megatron_rows(sliced, range(1, shard.rows, 2), LOCAL, None)
    assert [r.tolist() for r in rows] == docs[shard.start + 1 : shard.stop : 2]


@pytest.mark.filterwarnings("ignore")  # megatron-core warns of missing Apex and Transformer Engine on import
def test_files_written_by_megatron_core_read_back(tmp_path):
    try:
        import torch
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except ImportError as exc:
        pytest.skip(f"megatron-core is not installed ({exc}); the layout test below covers its format")
    docs = _docs(50, seed=3)
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for doc in docs[:-1]:
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.add_document(torch.tensor(docs[-1] + [7, 8]), [len(docs[-1]), 2])  # two sequences, one document
    builder.finalize(str(tmp_path / "m.idx"))
    assert _read_all(tmp_path / "m.bin", "megatron") == [*docs[:-1], docs[-1] + [7, 8]]


def test_flat_token_file_is_cut_after_each_eos_and_keeps_a_trailing_document(tmp_path, monkeypatch):
    monkeypatch.setattr(token_files, "SHARD_TOKENS", 100)
    monkeypatch.setattr(token_files, "_SCAN_TOKENS", 64)  # shard ends found across scan chunks
    eos = 50256
    docs = _docs(120, seed=4, high=eos)
    path = write_token_file(tmp_path / "train.bin", docs, eos)
    with open(path, "ab") as f:
        f.write(np.array([11, 12], dtype=np.uint16).tobytes())  # a last document with no eos
    layout = Pretokenized("uint16", eos)
    shards = index_file(str(path), "tokens", "text", 0, pretokenized=layout)
    assert len(shards) > 5
    assert shards[0].start == 0 and shards[-1].stop == path.stat().st_size // 2
    assert all(a.stop == b.start for a, b in zip(shards, shards[1:]))
    assert _read_all(path, "tokens", layout) == [[*d, eos] for d in docs] + [[11, 12]]


def test_flat_token_file_of_the_wrong_dtype_size_is_named(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(BadFile, match=r"3 bytes is not a whole number of uint16 tokens"):
        index_file(str(path), "tokens", "text", 0, pretokenized=Pretokenized("uint16", 0))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda idx: b"MMIDIDY\x00\x00" + idx[9:], r"d\.idx does not start with Megatron's .*not an MMIDIDX"),
        (lambda idx: idx[:-5], r"d\.idx is truncated: \d+ bytes, its header \(30 sequences, 30 documents\) needs"),
        (lambda idx: idx[:20], r"d\.idx is truncated: 20 bytes, a header takes 34"),
        (lambda idx: idx[:17] + bytes([6]) + idx[18:], r"tokens are float64 \(dtype code 6\)"),
        (lambda idx: idx[:9] + np.uint64(2).tobytes() + idx[17:], r"d\.idx version 2"),
    ],
)
def test_a_damaged_megatron_index_is_a_bad_file_saying_what_is_wrong(tmp_path, damage, message):
    bin_path = write_megatron(tmp_path / "d", [[d] for d in _docs(30, seed=5)])
    idx = tmp_path / "d.idx"
    idx.write_bytes(damage(idx.read_bytes()))
    with pytest.raises(BadFile, match=message):
        index_file(str(bin_path), "megatron", "text", 0)


def test_a_truncated_megatron_bin_and_a_missing_idx_are_named(tmp_path):
    bin_path = write_megatron(tmp_path / "d", [[d] for d in _docs(30, seed=6)])
    bin_path.write_bytes(bin_path.read_bytes()[:-4])
    with pytest.raises(BadFile, match=r"is truncated: \d+ bytes, its index places the last sequence up to byte"):
        index_file(str(bin_path), "megatron", "text", 0)
    (tmp_path / "d.idx").unlink()
    with pytest.raises(BadFile, match=r"no Megatron index .*d\.idx beside it.*format=tokens,eos=ID"):
        index_file(str(bin_path), "megatron", "text", 0)


def test_an_id_beyond_the_vocabulary_is_named_with_its_offset(tmp_path):
    docs = [[1, 2, 3], [4, 5], [6, 300, 7]]
    bin_path = write_megatron(tmp_path / "d", [[d] for d in docs])
    (shard,) = index_file(str(bin_path), "megatron", "text", 0)
    with pytest.raises(BadFile, match=r"token id 300 at token offset 6 \(document 2\) is not below the vocab"):
        read_shard(shard, "text", pretokenized=Pretokenized(vocab=256))
    flat = write_token_file(tmp_path / "t.bin", docs, eos=0)
    layout = Pretokenized("uint16", 0, 256)
    (shard,) = index_file(str(flat), "tokens", "text", 0, pretokenized=layout)
    with pytest.raises(BadFile, match=r"token id 300 at token offset 8 \(document 2 of the shard\)"):
        read_shard(shard, "text", pretokenized=layout)
    assert len(read_shard(shard, "text", pretokenized=Pretokenized("uint16", 0, 301))) == 3


def test_check_tokens_finds_the_first_id_out_of_range():
    assert token_files.check_tokens(np.array([0, 5, 9]), 10) is None
    assert token_files.check_tokens(np.array([0, 10, 11]), 10) == 1
    assert token_files.check_tokens(np.array([3, -1]), 10) == 1
    assert token_files.check_tokens(np.array([2**31]), None) == 0
    assert token_files.check_tokens(np.array([], dtype=np.int64), 1) is None


def test_ids_that_fit_uint16_are_read_as_uint16_and_the_others_as_int32(tmp_path):
    """A document's ids come out uint16 when every id must fit (a uint16 file, or checked below
    a vocabulary of at most 65,536), so the worker writes them without another pass; else
    int32; the same values either way."""
    docs = [d for d in _docs(60, seed=9, high=60000) if d]
    small = write_megatron(tmp_path / "small", [[d] for d in docs])  # uint16 in the file
    wide = write_megatron(tmp_path / "wide", [[d] for d in docs], dtype=np.int32)
    cases = [
        (small, None, np.uint16),
        (wide, None, np.int32),  # no vocabulary: an int32 file's ids may need 31 bits
        (wide, Pretokenized(vocab=60000), np.uint16),  # checked below a 60,000-id vocabulary
        (wide, Pretokenized(vocab=200_000), np.int32),
    ]
    for path, layout, dtype in cases:
        shards = index_file(str(path), "megatron", "text", 0, pretokenized=layout)
        arrays = [a for shard in shards for a in read_shard(shard, "text", pretokenized=layout)]
        assert {a.dtype for a in arrays} == {np.dtype(dtype)}, (path.name, layout)
        assert [a.tolist() for a in arrays] == docs
