"""Small corpora for the tests: deterministic documents in every supported format."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def documents(n: int, seed: int, min_words: int = 2, max_words: int = 120) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{seed}x{int(k)}" for k in rng.integers(0, 1000, rng.integers(min_words, max_words)))
            for _ in range(n)]


def write_parquet(path: Path, texts: list, column: str = "text", row_group_size: int = 50) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: texts}), path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, texts: list, column: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt") as f:
        for text in texts:
            f.write(json.dumps({column: text}) + "\n")
    return path


def write_arrow(path: Path, texts: list, column: str = "text", batch_rows: int = 40) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({column: texts})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for start in range(0, len(table), batch_rows):
            writer.write_batch(table.slice(start, batch_rows).to_batches()[0])
    return path


def make_mixed_corpus(root: Path) -> dict[str, str]:
    """Three sources in three formats (parquet, gzipped JSON lines, Arrow IPC); source name -> glob."""
    write_parquet(root / "web" / "a.parquet", documents(300, 1))
    write_parquet(root / "web" / "b.parquet", documents(200, 2))
    write_jsonl(root / "code" / "a.jsonl.gz", documents(250, 3), column="content")
    write_jsonl(root / "code" / "b.jsonl", documents(150, 4), column="content")
    write_arrow(root / "books" / "a.arrow", documents(60, 5, 200, 900))
    return {"web": str(root / "web" / "*.parquet"), "code": str(root / "code" / "*.jsonl*"),
            "books": str(root / "books" / "*.arrow")}


def mixed_sources(corpus: dict[str, str], weights=(0.6, 0.3, 0.1)) -> list[dict]:
    return [
        {"name": "web", "path": corpus["web"], "weight": weights[0]},
        {"name": "code", "path": corpus["code"], "weight": weights[1], "column": "content"},
        {"name": "books", "path": corpus["books"], "weight": weights[2]},
    ]
