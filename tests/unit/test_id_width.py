"""A source's token-id width, known at launch (catalog.id_bytes_of), sizes its rings' read-ahead
in tokens: where it says 2 bytes, the records its workers write must be UINT16."""

from __future__ import annotations

import numpy as np
import pytest

from omniload.coordinator.pool.catalog import id_bytes_of, pretokenized_of
from omniload.formats.records import RecordFlag, decode, doc_record, ids_fit_uint16
from omniload.spec import Spec
from omniload.workers.token_files import record_ids
from omniload.workers.transforms import load_transform


def _spec() -> Spec:
    return Spec.from_dict(
        {
            "sources": [
                {"name": "bytes", "path": "x"},
                {"name": "fn", "path": "x", "tokenizer": "json:loads"},
                {"name": "bin", "path": "x", "format": "tokens", "eos": 0},
                {"name": "wide", "path": "x", "format": "tokens", "eos": 0, "dtype": "int32"},
                {"name": "checked", "path": "x", "format": "tokens", "eos": 0, "dtype": "int32", "vocab": 50257},
            ],
            "seq_len": 64,
        }
    )


def _written_flags(ids: np.ndarray) -> RecordFlag:
    return decode(b"".join(bytes(part) for part in doc_record(0, 0, 0, ids))).flags


def test_each_kind_of_source_gets_the_width_its_ids_must_fit():
    spec = _spec()
    widths = {s.name: id_bytes_of(s, spec.tokenizer_of(s), pretokenized_of(s, None), None) for s in spec.sources}
    assert widths == {"bytes": 2, "fn": 4, "bin": 2, "wide": 4, "checked": 2}
    text = spec.sources[0]
    assert id_bytes_of(text, "t.json", None, 50257) == 2 and id_bytes_of(text, "t.json", None, 128256) == 4


def test_where_the_width_is_2_the_workers_write_uint16_records():
    # the byte tokenizer's ids
    (ids,) = load_transform("bytes")(["héllo wörld"])
    assert _written_flags(ids) & RecordFlag.UINT16
    # token files: a uint16 file, and int32 ids checked below a vocabulary of 50,257 (readers check first)
    for dtype, vocab in [(np.uint16, None), (np.int32, 50257)]:
        assert ids_fit_uint16(dtype, vocab)
        ids = record_ids(np.array([0, 7, 50256], dtype=dtype), vocab)
        assert _written_flags(ids) & RecordFlag.UINT16


def test_a_tokenizer_json_of_a_small_vocabulary_makes_uint16_ids(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (ids,) = load_transform(str(tmp_path / "tokenizer.json"))(["hello world"])
    assert ids.dtype == np.uint16 and _written_flags(ids) & RecordFlag.UINT16
