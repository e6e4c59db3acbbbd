"""Generated corpora for the benchmarks: K sources of text in parquet, JSON lines and Arrow IPC.

Document lengths are lognormal (median `median_bytes`); words come from a fixed vocabulary so
text compresses like real text. Written once per (name, size) into the cache folder.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CACHE = Path.home() / ".cache" / "omniload" / "bench"
_BPE_VOCAB = 32000
_FORMATS = ("parquet", "jsonl", "arrow")
_WORDS = np.array(
    [
        f"{w}{i}"
        for i, w in enumerate(
            "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore "
            "et dolore magna aliqua enim ad minim veniam quis nostrud exercitation ullamco laboris nisi aliquip".split()
            * 40
        )
    ]
)


def documents(n: int, seed: int, median_bytes: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = np.maximum(1, rng.lognormal(np.log(median_bytes / 7), 0.8, n).astype(int))
    flat = _WORDS[rng.integers(0, len(_WORDS), int(words.sum()))]
    bounds = np.concatenate([[0], np.cumsum(words)])
    return [" ".join(flat[bounds[i] : bounds[i + 1]]) for i in range(n)]


def make_sources(k: int, docs_per_source: int, median_bytes: int = 600, files_per_source: int = 2) -> list[dict]:
    """K sources (cycling through the formats); returns Spec source dicts with equal weights."""
    root = CACHE / f"k{k}-d{docs_per_source}-m{median_bytes}-f{files_per_source}"
    sources = []
    for s in range(k):
        fmt = _FORMATS[s % len(_FORMATS)]
        folder = root / f"s{s}"
        if not (folder / ".complete").exists():
            folder.mkdir(parents=True, exist_ok=True)
            texts = documents(docs_per_source, s, median_bytes)
            per_file = -(-len(texts) // files_per_source)
            for f in range(files_per_source):
                _write(folder / f"part{f}", fmt, texts[f * per_file : (f + 1) * per_file])
            (folder / ".complete").touch()
        sources.append({"name": f"s{s}", "path": str(folder / "part*"), "weight": 1.0})
    return sources


def _write(stem: Path, fmt: str, texts: list[str]) -> None:
    if fmt == "parquet":
        pq.write_table(pa.table({"text": texts}), stem.with_suffix(".parquet"), row_group_size=1000)
    elif fmt == "jsonl":
        with open(stem.with_suffix(".jsonl"), "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    else:
        table = pa.table({"text": texts})
        with pa.OSFile(str(stem.with_suffix(".arrow")), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            for start in range(0, len(table), 1000):
                w.write_batch(table.slice(start, 1000).to_batches()[0])


def bpe_tokenizer() -> str:
    """A byte-level BPE tokenizer.json (32k vocabulary), trained once on the standard library's
    Python sources (text unlike the corpus, so its words split into sub-words as real text does)."""
    path = CACHE / f"bpe-{_BPE_VOCAB}.json"
    if not path.exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=_BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        stdlib = sorted(Path(os.__file__).parent.glob("*.py"))
        tokenizer.train_from_iterator((p.read_text(errors="replace") for p in stdlib), trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(path))
    return str(path)


def us_per_token(tokenizer: str) -> float:
    """What the tokenizer costs on this corpus's documents, in one process, one document at a time
    (as omniload's workers call it on a slice's values): CPU microseconds a token, the unit the
    throughput benchmark counts workers in (wall time would count the other processes that
    share the core). Set TOKENIZERS_PARALLELISM=false first for one core's speed."""
    from omniload.workers.transforms import load_transform

    transform = load_transform(tokenizer)
    texts = documents(2000, 99, 600)
    transform(texts[:100])
    started = time.process_time()
    tokens = sum(len(t) for t in transform(texts))
    return (time.process_time() - started) / tokens * 1e6


def tokens_per_cpu_s_together(tokenizer: str, processes: int) -> float:
    """The tokenizer alone in `processes` forked processes at once (us_per_token in each, started
    together): the median of their tokens per CPU-second. Processes sharing cores slow each
    other's CPU-seconds (caches, a core's other hyperthread): with more processes than cores,
    each core switches between them all the time, which a job's workers, sometimes waiting on
    full rings, do less. A job's workers' figure falls between this and us_per_token's."""
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(processes), context.Queue()
    children = [
        context.Process(target=_speed_after, args=(tokenizer, start, results), daemon=True) for _ in range(processes)
    ]
    for child in children:
        child.start()
    try:
        speeds = [results.get(timeout=300) for _ in children]
    finally:
        for child in children:
            child.join(timeout=10)
            child.kill()
    failed = [s for s in speeds if isinstance(s, str)]
    if failed:
        raise RuntimeError(f"timing the tokenizer in {processes} processes at once failed: {failed[0]}")
    return statistics.median(speeds)


def _speed_after(tokenizer: str, start, results) -> None:  # noqa: ANN001  (multiprocessing's Barrier and queue)
    try:
        start.wait(timeout=60)
        results.put(1e6 / us_per_token(tokenizer))
    except Exception as exc:  # the parent says what failed, instead of waiting on a result
        results.put(f"{type(exc).__name__}: {exc}")
