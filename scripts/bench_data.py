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
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
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


def make_sources(
    k: int, docs_per_source: int, median_bytes: int = 600, files_per_source: int = 2, group_rows: int = 1000
) -> list[dict]:
    """K sources (cycling through the formats); returns Spec source dicts with equal weights.
    `group_rows`: rows of a parquet row group or an Arrow record batch (a shard)."""
    root = CACHE / f"k{k}-d{docs_per_source}-m{median_bytes}-f{files_per_source}"
    if group_rows != 1000:  # the caches written before the option keep their names
        root = root.with_name(f"{root.name}-g{group_rows}")
    sources = []
    for s in range(k):
        fmt = _FORMATS[s % len(_FORMATS)]
        folder = root / f"s{s}"
        if not (folder / ".complete").exists():
            folder.mkdir(parents=True, exist_ok=True)
            texts = documents(docs_per_source, s, median_bytes)
            per_file = -(-len(texts) // files_per_source)
            for f in range(files_per_source):
                _write(folder / f"part{f}", fmt, texts[f * per_file : (f + 1) * per_file], group_rows)
            (folder / ".complete").touch()
        sources.append({"name": f"s{s}", "path": str(folder / "part*"), "weight": 1.0})
    return sources


def _write(stem: Path, fmt: str, texts: list[str], group_rows: int) -> None:
    if fmt == "parquet":
        pq.write_table(pa.table({"text": texts}), stem.with_suffix(".parquet"), row_group_size=group_rows)
    elif fmt == "jsonl":
        with open(stem.with_suffix(".jsonl"), "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    else:
        table = pa.table({"text": texts})
        with pa.OSFile(str(stem.with_suffix(".arrow")), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            for start in range(0, len(table), group_rows):
                w.write_batch(table.slice(start, group_rows).to_batches()[0])


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


TIMED_DOCS = 2000  # documents a tokenizer timing tokenizes (some 1 s of a 32k BPE)


def us_per_token(tokenizer: str, docs: int = TIMED_DOCS) -> float:
    """What the tokenizer costs on this corpus's documents, in one process, one document at a time
    (as omniload's workers call it on a slice's values): CPU microseconds a token, the unit the
    throughput benchmark counts workers in (wall time would count the other processes that
    share the core). Set TOKENIZERS_PARALLELISM=false first for one core's speed. `docs`: fewer
    for a benchmark run at a smaller size (its figures are then rougher)."""
    return _tokenizer_timing(tokenizer, docs)()


def _tokenizer_timing(tokenizer: str, docs: int = TIMED_DOCS) -> Callable[[], float]:
    """us_per_token's measurement made ready (the tokenizer loaded and warmed, the texts made), so
    that processes timed together start timing together."""
    from omniload.workers.transforms import load_transform

    transform = load_transform(tokenizer)
    texts = documents(docs, 99, 600)
    transform(texts[:100])

    def timed() -> float:
        started = time.process_time()
        tokens = sum(len(t) for t in transform(texts))
        return (time.process_time() - started) / tokens * 1e6

    return timed


_TOGETHER_S = 300.0  # for each process's word: it imports, loads the tokenizer, then times ~1 s of tokens


def tokens_per_cpu_s_together(tokenizer: str, processes: int, docs: int = TIMED_DOCS) -> float:
    """The tokenizer alone in `processes` processes at once (us_per_token's measurement in each,
    the timing started together): the median of their tokens per CPU-second. More processes
    than cores time-slice the cores, and each one's CPU-seconds make fewer tokens (caches
    refilled after every switch, presumably). TOKENIZERS_PARALLELISM=false must be in the
    environment, as for us_per_token: the processes inherit it."""
    # spawned, not forked: a caller may have threads running (a Job's stderr relays). Pipes, not
    # a Barrier and a Queue: their semaphores would start multiprocessing's resource tracker,
    # a process that outlives this call
    context = multiprocessing.get_context("spawn")
    links, children = [], []
    for _ in range(processes):
        ours, theirs = context.Pipe()
        child = context.Process(target=_time_when_told, args=(tokenizer, theirs, docs), daemon=True)
        child.start()
        theirs.close()  # so that a child's death reads as the end of its pipe
        links.append(ours)
        children.append(child)
    try:
        for link, child in zip(links, children):
            _word_from(link, child, processes)  # ready: loaded and warmed
        for link in links:
            link.send("go")
        speeds = [1e6 / _word_from(link, child, processes) for link, child in zip(links, children)]
    finally:
        for link in links:  # a process still waiting for "go" (another one failed) reads the end
            link.close()
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
                child.join()
    return statistics.median(speeds)


def _word_from(link: Connection, child: BaseProcess, processes: int) -> float:
    """What a timing process sent: its microseconds a token, 0.0 for ready; raises with its cause."""
    failed = f"timing the tokenizer in {processes} processes at once failed"
    if not link.poll(_TOGETHER_S):
        raise RuntimeError(f"{failed}: process {child.pid} said nothing for {_TOGETHER_S:.0f} s")
    try:
        word = link.recv()
    except EOFError:
        child.join(timeout=10)
        raise RuntimeError(f"{failed}: process {child.pid} exited with code {child.exitcode}") from None
    if isinstance(word, str):
        raise RuntimeError(f"{failed}: {word}")
    return float(word)


def _time_when_told(tokenizer: str, link: Connection, docs: int) -> None:
    try:
        timed = _tokenizer_timing(tokenizer, docs)
        link.send(0.0)
        link.recv()
        link.send(timed())
    except EOFError:
        pass  # the parent stopped waiting: another process failed
    except Exception as exc:  # the parent says what failed, instead of waiting on a figure
        link.send(f"{type(exc).__name__}: {exc}")
