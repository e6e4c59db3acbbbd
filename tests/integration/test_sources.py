"""Source formats and transforms end to end: pre-tokenized columns, Hugging Face tokenizers."""

from __future__ import annotations

from pathlib import Path

import pytest

import omniload
from omniload.workers.transforms import load_transform
from tests.corpus import write_arrow, write_jsonl, write_parquet
from tests.jobs import collect, run_ranks, start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_pretokenized_list_column_is_used_as_is(tmp_path):
    docs = [list(range(i, i + 5 + i % 7)) for i in range(100)]
    write_parquet(tmp_path / "tok.parquet", docs, column="ids")
    write_jsonl(tmp_path / "tok.jsonl", docs, column="ids")
    spec = {
        "sources": [
            {"name": "p", "path": str(tmp_path / "tok.parquet"), "column": "ids"},
            {"name": "j", "path": str(tmp_path / "tok.jsonl"), "column": "ids"},
        ],
        "seq_len": 32,
        "rows": 2,
        "workers": 2,
    }
    (rank,) = run_ranks(spec, world=1, out_dir=tmp_path)
    # every document arrives once per source, with its exact token count
    assert sum(rank["source_tokens"].values()) == 2 * sum(len(d) for d in docs)
    assert len(rank["sample_ids"]) == 200


def _word_tokenizer(folder: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "omniload": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_huggingface_tokenizer_file(tmp_path):
    _word_tokenizer(tmp_path)
    write_arrow(tmp_path / "t.arrow", ["hello world omniload"] * 30 + ["hello unknown"] * 10)
    spec = {
        "sources": [f"t={tmp_path}/t.arrow"],
        "seq_len": 8,
        "rows": 4,
        "tokenizer": str(tmp_path / "tokenizer.json"),
    }
    (rank,) = run_ranks(spec, world=1, out_dir=tmp_path)
    assert sum(rank["source_tokens"].values()) == 30 * 3 + 10 * 2


def test_the_vocabulary_is_the_workers_never_the_coordinators(tmp_path):
    """A real vocabulary is tens of MB: the coordinator checks it in a short-lived child, and a
    worker's lanes share one copy."""
    path = str(_word_tokenizer(tmp_path))
    assert load_transform(path) is load_transform(path)
    for name in ("a", "b", "c"):
        write_arrow(tmp_path / f"{name}.arrow", ["hello world omniload"] * 20)
    spec = {"sources": [f"{n}={tmp_path}/{n}.arrow" for n in "abc"], "seq_len": 8, "rows": 2, "workers": 1}
    with omniload.Job({**spec, "tokenizer": path}) as job:
        (rank,) = collect(start_ranks(job, 1, tmp_path))
        coordinator_maps = Path(f"/proc/{job._process.pid}/maps").read_text()
    assert sum(rank["source_tokens"].values()) == 3 * 20 * 3
    assert "tokenizers" not in coordinator_maps
