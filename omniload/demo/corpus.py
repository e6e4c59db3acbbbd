"""The demo corpus: three sources in three formats, made once into a cache folder.

- `stdlib` (parquet): real text, the standard library's own .py files.
- `short` (JSON lines): generated short documents, simple templated sentences.
- `long` (Arrow IPC): generated long documents, numbered inventories of a few kilobytes.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from omniload.spec import Spec

_VERSION = "v1"
_WORDS = (
    "cat dog bird fish tree river stone cloud lamp door book chair road ship bell wall "
    "red blue green small large quiet bright old new warm cold"
).split()


def make_corpus(directory: str | os.PathLike | None = None) -> Path:
    """Write the corpus if it is not there yet; return its folder."""
    root = Path(directory or Path.home() / ".cache" / "omniload" / "demo") / _VERSION
    done = root / ".complete"
    if done.exists():
        return root
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("stdlib", "short", "long"):
        (root / name).mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": _stdlib_texts()}), root / "stdlib" / "stdlib.parquet", row_group_size=16)
    rng = np.random.default_rng(0)
    for part in range(2):
        with open(root / "short" / f"short-{part}.jsonl", "w") as f:
            for _ in range(1500):
                f.write(json.dumps({"text": _short_doc(rng)}) + "\n")
    table = pa.table({"text": [_long_doc(rng) for _ in range(60)]})
    with pa.OSFile(str(root / "long" / "long.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for start in range(0, len(table), 10):
            writer.write_batch(table.slice(start, 10).to_batches()[0])
    done.touch()
    return root


def demo_spec(root: Path, steps: int, seq_len: int = 256, rows: int = 4) -> Spec:
    return Spec.from_dict(
        {
            "sources": [
                {"name": "stdlib", "path": str(root / "stdlib" / "*.parquet"), "weight": 0.5},
                {"name": "short", "path": str(root / "short" / "*.jsonl"), "weight": 0.3},
                {"name": "long", "path": str(root / "long" / "*.arrow"), "weight": 0.2},
            ],
            "seq_len": seq_len,
            "rows": rows,
            "workers": 3,
            "seed": 0,
            "epochs": 0,
            "steps": steps,
        }
    )


def _stdlib_texts(limit: int = 400, max_chars: int = 16_000) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:limit]
    return [f.read_text(errors="replace")[:max_chars] for f in files]


def _short_doc(rng: np.random.Generator) -> str:
    sentences = []
    for _ in range(rng.integers(2, 6)):
        a, b, c = rng.choice(_WORDS, 3)
        sentences.append(f"the {a} saw a {b} near the {c}.")
    return " ".join(sentences)


def _long_doc(rng: np.random.Generator) -> str:
    start = int(rng.integers(0, 1000))
    return "\n".join(f"item {start + i}: {' '.join(rng.choice(_WORDS, 3))}" for i in range(int(rng.integers(100, 400))))
