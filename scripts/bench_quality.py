"""Batch quality: what a model learns from omniload's batches against the global shuffles users
run instead, on three held-out evaluations, one of which favours no sampler.

Corpora (written once into ~/.cache/omniload/quality-v3-NAME; one document in 20 held out):
  bench   code        parquet     this Python's standard library .py files (up to 250 x seq_len each)
          docs        JSON lines  package documentation generated from a seed (quality_corpus.py)
          changelogs  Arrow IPC   Debian-style changelogs generated from a seed
  heavy   the same three, docs and changelogs with heavy tails: documents of 100k tokens or more
          hold at least 30% of each of their tokens (books, logs, changelogs)
  smoke   bench's shape at a fourteenth of its tokens (3.1M), for the test suite (its figures mean nothing)
Files are written in sorted path order, so a reader that takes documents in file order sees
one package or one module family at a time.

Arms, each training the demo's tiny GPT for the same steps, rows, ranks and seed (rows go to
sources by the weights, by stride scheduling):
  windows          nanoGPT's sampler: seq_len windows at random offsets of each source's token
                   stream (its files' documents in order), attention across documents
  chunks           Megatron's GPTDataset: each source's documents in a seeded order, concatenated
                   and cut into seq_len chunks, the chunks in a seeded permutation; attention
                   across documents
  omniload         a real job (coordinator, workers, rings, TCP) with the default options, read by
                   DP clients in this process; attention within each packed document (cu_seqlens)
  omniload-nomask  omniload's batches, the model attending across a row's packed documents
                   with positions 0..seq_len-1 (TinyGPT(doc_mask=False)); evaluated alike
  chunks-reshuffled  chunks under another shuffle of the same seed: its gap to chunks is the
                   noise floor, what a sampler's own randomness moves the loss by
  chunks-masked    chunks' rows with omniload's document mask (each piece attends to itself,
                   positions from its start): the mask's effect apart from the sampler's

Evaluations, per source on its held-out documents (the report weighs sources by the weights):
  windows    random seq_len windows of the held-out documents concatenated (favours the arms
             that train across documents)
  starts     each document's first seq_len tokens alone (favours packing)
  documents  every token of each document from its start, windows at stride seq_len/2, each
             token scored once with its own document before it and nothing else (documents
             longer than _EVAL_DOC_TOKENS are scored on their first _EVAL_DOC_TOKENS): neutral

Per arm also: the mixture's error per step, per-step diversity (distinct documents in a
global step, and the largest share of a step's tokens from one document, overall and per
source), documents seen in the run, and for omniload its time to first batch.

    python -m scripts.bench_quality [--corpus bench|heavy] [--length short|10x|30x]
                                    [--seeds 0,1,2] [--arms windows,chunks,omniload,...] (all six by default)
                                    [--json results.json]
    python -m scripts.bench_quality --merge a.json b.json [--json merged.json]
        the summary of runs made apart (arms of one corpus, length and seeds), as if made at once
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

import omniload
from omniload.demo.train import VOCAB, TinyGPT
from scripts import quality_corpus
from scripts.harness import Figure, write_results

WEIGHTS = {"code": 0.5, "docs": 0.3, "changelogs": 0.2}
SEQ, DP = 256, 2
# run lengths: rows a rank and steps; 10x and 30x the tokens of `short`, with larger batches
LENGTHS = {"short": (4, 200), "10x": (16, 500), "30x": (32, 750)}
_MAX_DOC_BYTES = 250 * SEQ
_HOLDOUT = 20  # one document in this many is held out
_CORPUS_SEED = 20261124
_DOCS_PACKAGES, _CHANGELOG_PACKAGES = 950, 5000  # about 9 MB and 24 MB
_EVAL_DOC_TOKENS = 16 * SEQ
_LR = 3e-3


@dataclass(frozen=True)
class Corpus:
    """How one corpus is generated: the docs' and changelogs' length distributions."""

    name: str
    doc_median: float = 1500
    doc_sigma: float = 1.2
    log_entries: float = 12
    log_sigma: float = 1.1
    max_long_bytes: int = _MAX_DOC_BYTES
    docs_packages: int = _DOCS_PACKAGES
    log_packages: int = _CHANGELOG_PACKAGES
    code_files: int = 0  # the first this many of the standard library's files in path order; 0: all

    @property
    def cache(self) -> Path:
        return Path.home() / ".cache" / "omniload" / f"quality-v3-{self.name}"


CORPORA = {
    "bench": Corpus("bench"),
    # lognormal tails reaching 100k-400k bytes: such documents hold 30-50% of each source's tokens
    "heavy": Corpus(
        "heavy", doc_sigma=2.3, log_sigma=2.0, max_long_bytes=400_000, docs_packages=420, log_packages=1400
    ),
    # the test suite's: the bench corpus' shape, 3.1M tokens against 43M, written in 1-3.5 s
    "smoke": Corpus("smoke", docs_packages=50, log_packages=250, code_files=100),
}


# -- corpus -----------------------------------------------------------------------------------
def _texts(corpus: Corpus) -> dict[str, list[tuple[str, str]]]:
    """(path, text) per source, in sorted path order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = []
    paths = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    for path in paths[: corpus.code_files or None]:
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")[:_MAX_DOC_BYTES]
        except OSError:
            continue
        if len(text) >= 16:
            code.append((str(path.relative_to(stdlib)), text))
    docs = quality_corpus.docs(
        _CORPUS_SEED, corpus.docs_packages, corpus.max_long_bytes, corpus.doc_median, corpus.doc_sigma
    )
    logs = quality_corpus.changelogs(
        _CORPUS_SEED + 1, corpus.log_packages, corpus.max_long_bytes, corpus.log_entries, corpus.log_sigma
    )
    return {"code": code, "docs": docs, "changelogs": logs}


def _held_out(path: str) -> bool:
    return not int(hashlib.md5(path.encode()).hexdigest(), 16) % _HOLDOUT


def make_corpus(corpus: Corpus) -> Path:
    root = corpus.cache
    if (root / ".complete").exists():
        return root
    for name, docs in _texts(corpus).items():
        train = [t for p, t in docs if not _held_out(p)]
        held = [t for p, t in docs if _held_out(p)]
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (root / f"{name}.heldout.json").write_text(json.dumps(held))
        if name == "code":
            pq.write_table(pa.table({"text": train}), folder / "code.parquet", row_group_size=64)
        elif name == "docs":
            half = len(train) // 2
            for i, part in enumerate((train[:half], train[half:])):
                with open(folder / f"docs-{i}.jsonl", "w") as f:
                    f.writelines(json.dumps({"text": t}) + "\n" for t in part)
        else:
            table = pa.table({"text": train})
            with (
                pa.OSFile(str(folder / "changelogs.arrow"), "wb") as sink,
                pa.ipc.new_file(sink, table.schema) as writer,
            ):
                for start in range(0, len(table), 32):
                    writer.write_batch(table.slice(start, 32).to_batches()[0])
    (root / ".complete").touch()
    return root


def _encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)


def _bytes_of(text: str) -> np.ndarray:
    """A training document's tokens as bytes (the bytes tokenizer's ids all fit): an eighth of
    the memory the streams' concatenations copy; rows are made int64 as they are cut (_Streams.row)."""
    return np.frombuffer(text.encode("utf-8"), np.uint8)


def train_documents(root: Path) -> list[list[np.ndarray]]:
    """Each source's training documents as the bytes tokenizer makes them, in file order."""
    from omniload.formats.shards import detect_format
    from omniload.workers.readers import index_file, read_shard

    out = []
    for name in WEIGHTS:
        texts: list[str] = []
        for path in sorted((root / name).iterdir()):
            if fmt := detect_format(str(path)):
                texts += [v for shard in index_file(str(path), fmt, "text", 0) for v in read_shard(shard, "text")]
        out.append([_bytes_of(t) for t in texts])
    return out


def long_share(docs: list[np.ndarray], at_least: int = 100_000) -> float:
    lengths = np.array([len(d) for d in docs])
    return float(lengths[lengths >= at_least].sum() / lengths.sum())


# -- the arms: each gives steps of DP rank batches ----------------------------------------------
@dataclass
class RankBatch:
    input_ids: np.ndarray  # [rows, SEQ]
    labels: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    seg_source: np.ndarray  # per segment: source index, -1 for padding
    seg_doc: np.ndarray  # per segment: a document id unique in the run, -1 for padding
    seg_len: np.ndarray


Steps = list[list[RankBatch]]


def omniload_steps(root: Path, rows: int, steps: int, seed: int, figures: dict, **extra) -> Steps:
    paths = {"code": "code/*.parquet", "docs": "docs/*.jsonl", "changelogs": "changelogs/*.arrow"}
    spec = {
        "sources": [{"name": n, "path": str(root / paths[n]), "weight": w} for n, w in WEIGHTS.items()],
        "seq_len": SEQ,
        "rows": rows,
        "seed": seed,
        "epochs": 0,
        "steps": steps,
        "workers": 2,
        **extra,
    }
    out: Steps = []
    started = time.perf_counter()
    with omniload.Job(spec) as job:
        env = job.env()
        clients = [
            omniload.connect(env["OMNILOAD_ADDR"], env["OMNILOAD_TOKEN"], rank=r, world_size=DP) for r in range(DP)
        ]
        for batches in zip(*clients):
            if not out:
                figures["first_batch_s"] = time.perf_counter() - started
            step = []
            for b in batches:
                cu = b["cu_seqlens"].numpy().astype(np.int64)
                ids = b["sample_id"].numpy()
                step.append(
                    RankBatch(
                        b["input_ids"].numpy().copy(),
                        b["labels"].numpy().copy(),
                        b["position_ids"].numpy().copy(),
                        cu,
                        b["source"].numpy().copy(),
                        np.where(ids >= 0, ids >> 12, -1),  # the chunk bits off: the document
                        np.diff(cu),
                    )
                )
            out.append(step)
        for client in clients:
            client.close()
    return out


class _Streams:
    """Each source's documents concatenated (`only`: just that source's; the others stay empty),
    with where each document starts."""

    def __init__(
        self, docs: list[list[np.ndarray]], order: list[np.ndarray] | None = None, only: int | None = None
    ) -> None:
        self.tokens, self.starts, self.ids = [], [], []
        for s, source_docs in enumerate(docs):
            index = np.arange(len(source_docs)) if order is None else order[s]
            if only is not None and s != only:
                index = index[:0]
            self.tokens.append(np.concatenate([source_docs[i] for i in index] or [np.zeros(0, np.uint8)]))
            self.starts.append(np.concatenate([[0], np.cumsum([len(source_docs[i]) for i in index])]))
            self.ids.append(index)

    def row(self, source: int, start: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """SEQ tokens from `start`, and (document id, tokens) of each document they cut."""
        starts = self.starts[source]
        first, last = np.searchsorted(starts, [start, start + SEQ], side="right") - 1
        parts = []
        for d in range(first, min(last, len(starts) - 2) + 1):
            overlap = min(starts[d + 1], start + SEQ) - max(starts[d], start)
            if overlap > 0:
                parts.append((source << 40 | int(self.ids[source][d]), int(overlap)))
        return self.tokens[source][start : start + SEQ].astype(np.int64), parts


def _stream_steps(rows: int, steps: int, pick: Callable[[int, int], tuple[np.ndarray, list]]) -> Steps:
    """Steps whose rows go to sources by the weights (stride scheduling over rows); pick(source,
    k) gives the k-th row drawn from a source."""
    weights = np.array(list(WEIGHTS.values()))
    drawn = np.zeros(len(weights))
    out = []
    for _ in range(steps):
        step = []
        for _ in range(DP):
            ids, sources, docs, lens = [], [], [], []
            for _ in range(rows):
                s = int(np.argmin((drawn + 1) / weights))
                tokens, parts = pick(s, int(drawn[s]))
                drawn[s] += 1
                ids.append(tokens)
                for doc, n in parts:
                    sources.append(s)
                    docs.append(doc)
                    lens.append(n)
            input_ids = np.stack(ids)
            labels = np.concatenate([input_ids[:, 1:], np.full((rows, 1), -100)], axis=1)
            step.append(
                RankBatch(
                    input_ids,
                    labels,
                    np.tile(np.arange(SEQ), (rows, 1)),
                    np.arange(0, rows * SEQ + 1, SEQ),
                    np.array(sources),
                    np.array(docs),
                    np.array(lens),
                )
            )
        out.append(step)
    return out


def windows_steps(docs: list[list[np.ndarray]], rows: int, steps: int, seed: int) -> Steps:
    """nanoGPT's get_batch: a uniform random offset into the source's stream for every row."""
    streams = _Streams(docs)
    rngs = [np.random.default_rng([seed, s, 0x9A90]) for s in range(len(docs))]
    return _stream_steps(
        rows, steps, lambda s, k: streams.row(s, int(rngs[s].integers(0, len(streams.tokens[s]) - SEQ)))
    )


def chunks_steps(docs: list[list[np.ndarray]], rows: int, steps: int, seed: int, shuffle: int = 0) -> Steps:
    """Megatron's GPTDataset: documents shuffled, concatenated, cut into SEQ chunks (the last
    partial one dropped), the chunks shuffled; a new epoch reshuffles both. `shuffle` picks
    another shuffle of the same seed (the model's initialisation and evaluation stay)."""
    epochs: dict[tuple[int, int], tuple[_Streams, np.ndarray]] = {}

    def pick(s: int, k: int) -> tuple[np.ndarray, list]:
        per_epoch = sum(len(d) for d in docs[s]) // SEQ
        epoch, k = divmod(k, per_epoch)
        if (s, epoch) not in epochs:
            rng = np.random.default_rng([seed, s, epoch, 0x3E6A] + ([shuffle] if shuffle else []))
            order = [np.arange(len(d)) for d in docs]
            order[s] = rng.permutation(len(docs[s]))
            epochs[(s, epoch)] = (_Streams(docs, order, only=s), rng.permutation(per_epoch))
        streams, chunks = epochs[(s, epoch)]
        return streams.row(s, int(chunks[k]) * SEQ)

    return _stream_steps(rows, steps, pick)


def with_document_mask(steps: Steps) -> Steps:
    """The same rows, each document's piece attending to itself alone, positions from the
    piece's start and its last token predicting nothing (as omniload's batches)."""
    out = []
    for step in steps:
        batches = []
        for b in step:
            shape = b.input_ids.shape
            cu = np.concatenate([[0], np.cumsum(b.seg_len)])
            labels = b.labels.reshape(-1).copy()
            labels[cu[1:] - 1] = -100
            positions = np.concatenate([np.arange(n) for n in b.seg_len]).reshape(shape)
            batches.append(
                RankBatch(b.input_ids, labels.reshape(shape), positions, cu, b.seg_source, b.seg_doc, b.seg_len)
            )
        out.append(batches)
    return out


# -- what the batches hold --------------------------------------------------------------------
def batch_figures(steps: Steps) -> dict[str, float]:
    """Mixture error (percentage points) and per-step diversity over the global step."""
    weights = np.array(list(WEIGHTS.values()))
    shares, distinct, top, top_by_source = [], [], [], []
    seen: set[int] = set()
    for step in steps:
        sources = np.concatenate([b.seg_source for b in step])
        docs = np.concatenate([b.seg_doc for b in step])
        lens = np.concatenate([b.seg_len for b in step])
        real = sources >= 0
        sources, docs, lens = sources[real], docs[real], lens[real]
        shares.append(np.bincount(sources, weights=lens, minlength=len(weights)))
        ids, per_doc = np.unique(docs, return_inverse=True)
        seen.update(ids.tolist())
        doc_tokens = np.bincount(per_doc, weights=lens)
        distinct.append(len(ids))
        top.append(doc_tokens.max() / lens.sum())
        doc_source = ids >> 40
        top_by_source.append(
            [
                doc_tokens[doc_source == s].max() / max(1, lens[sources == s].sum()) if (doc_source == s).any() else 0
                for s in range(len(weights))
            ]
        )
    shares_arr = np.array(shares)
    error = np.abs(shares_arr / shares_arr.sum(1, keepdims=True) - weights).max(1) * 100
    figures = {
        "step_err_mean": float(error.mean()),
        "distinct_docs": float(np.mean(distinct)),
        "top_doc_share": float(np.mean(top)),
        "docs_in_run": len(seen),
    }
    for s, name in enumerate(WEIGHTS):
        figures[f"top_doc_share_{name}"] = float(np.mean([t[s] for t in top_by_source]))
    return figures


# -- training and held-out loss ---------------------------------------------------------------
def _logits(model: TinyGPT, ids: np.ndarray, positions: np.ndarray, cu: np.ndarray) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(*(torch.from_numpy(a).long().to(device) for a in (ids, positions, cu)))


def train(steps: Steps, seed: int, doc_mask: bool = True, device: str = "cpu") -> TinyGPT:
    """DP ranks' gradients averaged, as DDP does: the mean of each rank's mean loss. The arms
    without documents in their rows train the same either way (one segment a row)."""
    torch.manual_seed(seed)
    model = TinyGPT(SEQ, doc_mask=doc_mask).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LR)
    for step in steps:
        loss = sum(_mean_loss(model, b.input_ids, b.position_ids, b.cu_seqlens, b.labels) for b in step) / len(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model


def _mean_loss(model: TinyGPT, ids: np.ndarray, positions: np.ndarray, cu: np.ndarray, labels: np.ndarray):
    logits = _logits(model, ids, positions, cu)
    targets = torch.from_numpy(labels).long().to(logits.device)
    return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-100)


@dataclass
class EvalRows:
    """Rows to score: tokens, labels (-100 where not scored), positions and segment bounds."""

    ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    cu: np.ndarray


def _rows(pieces: list[tuple[np.ndarray, int]], masked: bool) -> list[EvalRows]:
    """Batches of one piece a row: (tokens up to SEQ + 1, tokens not scored at its start).
    `masked`: the piece is its row's only segment (padding after it); else it fills the row."""
    out = []
    for i in range(0, len(pieces), 8):
        batch = pieces[i : i + 8]
        ids = np.zeros((len(batch), SEQ), dtype=np.int64)
        labels = np.full((len(batch), SEQ), -100, dtype=np.int64)
        cu = [0]
        for r, (tokens, skip) in enumerate(batch):
            n = min(SEQ, len(tokens) - 1)
            ids[r, :n] = tokens[:n]
            labels[r, skip:n] = tokens[skip + 1 : n + 1]
            cu += [r * SEQ + n] + ([(r + 1) * SEQ] if masked and n < SEQ else [])
        if not masked:
            cu = list(range(0, len(batch) * SEQ + 1, SEQ))
        out.append(EvalRows(ids, labels, np.tile(np.arange(SEQ), (len(batch), 1)), np.array(cu)))
    return out


def heldout_sets(root: Path, seed: int, eval_docs: int, eval_windows: int) -> dict[str, list[list[EvalRows]]]:
    """Per evaluation, per source, the rows to score (see the module's doc)."""
    rng = np.random.default_rng([seed, 99])
    sets: dict[str, list[list[EvalRows]]] = {"windows": [], "starts": [], "documents": []}
    for name in WEIGHTS:
        docs = [_encode(t) for t in json.loads((root / f"{name}.heldout.json").read_text())]
        docs = [d for d in docs if len(d) > 1]
        stream = np.concatenate(docs)
        starts = rng.choice(len(stream) - SEQ - 1, eval_windows, replace=False)
        sets["windows"].append(_rows([(stream[a : a + SEQ + 1], 0) for a in starts], masked=False))
        picked = [docs[i] for i in rng.choice(len(docs), min(eval_windows, len(docs)), replace=False)]
        sets["starts"].append(_rows([(d[: SEQ + 1], 0) for d in picked], masked=True))
        pieces = []
        for i in rng.choice(len(docs), min(eval_docs, len(docs)), replace=False):
            doc = docs[i][: _EVAL_DOC_TOKENS + 1]
            pieces.append((doc[: SEQ + 1], 0))  # from the start: every prediction
            a = SEQ // 2
            while len(doc) - 1 - a > SEQ // 2:  # then each window's last SEQ/2 predictions
                pieces.append((doc[a : a + SEQ + 1], SEQ // 2))
                a += SEQ // 2
        sets["documents"].append(_rows(pieces, masked=True))
    return sets


@torch.no_grad()
def heldout_loss(model: TinyGPT, per_source: list[list[EvalRows]]) -> dict[str, float]:
    """Per source the mean loss over its scored tokens, and their mixture-weighted mean."""
    out = {}
    for name, batches in zip(WEIGHTS, per_source):
        total, count = 0.0, 0
        for rows in batches:
            logits = _logits(model, rows.ids, rows.positions, rows.cu)
            labels = torch.from_numpy(rows.labels).to(logits.device)
            total += float(F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
        out[name] = total / count
    out["mix"] = sum(w * out[name] for name, w in WEIGHTS.items())
    return out


# -- the run ----------------------------------------------------------------------------------
ARMS = ("windows", "chunks", "omniload", "omniload-nomask", "chunks-reshuffled", "chunks-masked")


def run_seed(
    root: Path,
    docs: list[list[np.ndarray]],
    arms: list[str],
    rows: int,
    steps: int,
    seed: int,
    eval_docs: int,
    eval_windows: int,
    device: str = "cpu",
) -> dict:
    evals = heldout_sets(root, seed, eval_docs, eval_windows)
    results: dict[str, dict] = {}
    batches: dict[str, Steps] = {}
    for arm in arms:
        started = time.perf_counter()
        figures: dict = {}
        if arm == "windows":
            steps_of_arm = windows_steps(docs, rows, steps, seed)
        elif arm == "chunks":
            steps_of_arm = chunks_steps(docs, rows, steps, seed)
        elif arm == "chunks-reshuffled":
            steps_of_arm = chunks_steps(docs, rows, steps, seed, shuffle=1)
        elif arm == "chunks-masked":
            steps_of_arm = with_document_mask(chunks_steps(docs, rows, steps, seed))
        elif arm == "omniload":
            steps_of_arm = batches["omniload"] = omniload_steps(root, rows, steps, seed, figures)
        else:  # the same batches, the model attending across the rows' documents
            if "omniload" not in batches:
                batches["omniload"] = omniload_steps(root, rows, steps, seed, figures)
            steps_of_arm = batches["omniload"]
        figures.update(batch_figures(steps_of_arm))
        model = train(steps_of_arm, seed, doc_mask=arm != "omniload-nomask", device=device)
        for evaluation, per_source in evals.items():
            figures[f"loss_{evaluation}"] = heldout_loss(model, per_source)
        figures["seconds"] = time.perf_counter() - started
        results[arm] = figures
        losses = "  ".join(f"{e} {figures[f'loss_{e}']['mix']:.4f}" for e in evals)
        print(f"  seed {seed} {arm:<16} {losses}  [{figures['seconds']:.0f}s]", flush=True)
    return results


def summarize(results: dict[str, list[dict]], baseline: str) -> None:
    """Each arm's means, and its gap to `baseline` per evaluation (mean, min..max over seeds)."""
    evaluations = ("windows", "starts", "documents")
    print(
        f"\n{'arm':<17}{'step err pp':>12}{'docs/step':>10}{'top doc share':>14}{'docs in run':>12}"
        + "".join(f"{'loss ' + e:>16}" for e in evaluations)
    )
    for arm, rows in results.items():
        mean = {k: float(np.mean([r[k] for r in rows])) for k in ("step_err_mean", "distinct_docs", "top_doc_share")}
        losses = "".join(f"{np.mean([r[f'loss_{e}']['mix'] for r in rows]):>16.4f}" for e in evaluations)
        print(
            f"{arm:<17}{mean['step_err_mean']:>12.1f}{mean['distinct_docs']:>10.1f}"
            f"{mean['top_doc_share']:>14.4f}{np.mean([r['docs_in_run'] for r in rows]):>12.0f}{losses}"
        )
    for arm in results:
        if arm == baseline:
            continue
        gaps = []
        for e in evaluations:
            per_seed = [a[f"loss_{e}"]["mix"] - b[f"loss_{e}"]["mix"] for a, b in zip(results[arm], results[baseline])]
            gaps.append(f"{e} {np.mean(per_seed):+.4f} ({min(per_seed):+.4f}..{max(per_seed):+.4f})")
        print(f"{arm} - {baseline}: " + ", ".join(gaps))


def merge(paths: list[Path]) -> dict:
    """The runs' figures as one run's: they must share corpus, rows, steps and seeds."""
    runs = [json.loads(path.read_text()) for path in paths]
    keys = ("corpus", "rows", "steps", "dp", "seq_len", "seeds")
    for path, run in zip(paths[1:], runs[1:]):
        if any(run[k] != runs[0][k] for k in keys):
            raise SystemExit(f"{path}: not the same corpus, length and seeds as {paths[0]}")
    results = {arm: figures for run in runs for arm, figures in run["results"].items()}
    measured = {
        k: ", ".join(dict.fromkeys(str(run.get(k, "?")) for run in runs)) for k in ("commit", "date", "machine")
    }
    return {**{k: runs[0][k] for k in keys}, "results": results, "measured": measured}


def _signed(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def quality_figures(run: dict) -> list[Figure]:
    """The summary's rows for one corpus and length (a --json file's keys, merged or not): the
    loss gaps to chunks on whole documents and to windows on windows (mean over seeds, the
    per-seed range), and distinct documents a step against chunks; those whose arms ran."""
    results = run["results"]
    named = {shape: name for name, shape in LENGTHS.items()}
    length = named.get((run["rows"], run["steps"]), f"{run['rows']} rows × {run['steps']} steps")
    setting = f"{run['corpus']} corpus, {length}"
    count = len(run["seeds"].split(","))
    seeds = f"{count} seed" + ("s" if count > 1 else "")

    def differences(arm: str, baseline: str, evaluation: str) -> list[float]:
        return [
            a[f"loss_{evaluation}"]["mix"] - b[f"loss_{evaluation}"]["mix"]
            for a, b in zip(results[arm], results[baseline])
        ]

    def spread(per_seed: list[float]) -> str:
        return f"{_signed(min(per_seed))} to {_signed(max(per_seed))}, {seeds}"

    def gap(baseline: str, evaluation: str) -> tuple[str, float]:
        per_seed = differences("omniload", baseline, evaluation)
        return f"{_signed(float(np.mean(per_seed)))} ({spread(per_seed)})", float(np.mean(per_seed))

    figures = []
    if "omniload" in results and "chunks" in results:
        value, _ = gap("chunks", "documents")
        figures.append(
            Figure(
                f"held-out loss on whole documents, omniload − Megatron's chunks, {setting} (within seed noise)",
                value,
                "permutation of chunks",
            )
        )
    if "chunks-reshuffled" in results and "chunks" in results:
        # a reshuffle's difference has mean 0: its size, not its sign, is the noise
        per_seed = differences("chunks-reshuffled", "chunks", "documents")
        figures.append(
            Figure(
                f"noise floor: held-out loss on whole documents, |chunks reshuffled − chunks|, {setting}",
                f"{float(np.mean(np.abs(per_seed))):.3f} ({spread(per_seed)})",
                "permutation of chunks",
            )
        )
    if "omniload" in results and "windows" in results:
        value, mean = gap("windows", "windows")
        figures.append(
            Figure(
                f"held-out loss on random windows, omniload − nanoGPT's windows, {setting} (≤ +0.02)",
                f"{value}: {'**met**' if mean <= 0.02 else '**missed**'}",
                "random windows",
            )
        )
    if "omniload" in results and "chunks" in results:
        ratios = [a["distinct_docs"] / b["distinct_docs"] for a, b in zip(results["omniload"], results["chunks"])]
        ratio = float(np.mean([a["distinct_docs"] for a in results["omniload"]])) / float(
            np.mean([b["distinct_docs"] for b in results["chunks"]])
        )
        figures.append(
            Figure(
                f"distinct documents a step, omniload / chunks, {setting} (within 10%)",
                f"{ratio:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x, {seeds}): "
                + ("**met**" if abs(ratio - 1) <= 0.1 else "**missed**"),
                "permutation of chunks",
            )
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="bench")
    parser.add_argument("--length", choices=list(LENGTHS), default="short", help="rows a rank and steps")
    parser.add_argument("--rows", type=int, help="rows a rank (overrides --length's)")
    parser.add_argument("--steps", type=int, help="steps (overrides --length's)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"a comma list of {', '.join(ARMS)}")
    parser.add_argument("--baseline", default="chunks", help="the arm the others are compared with")
    parser.add_argument("--eval-docs", type=int, default=64, help="held-out documents a source, for `documents`")
    parser.add_argument("--eval-windows", type=int, default=96, help="held-out windows (and document starts) a source")
    parser.add_argument("--json", type=Path, help="write every seed's figures here")
    parser.add_argument("--threads", type=int, default=2, help="torch's threads for training and evaluation")
    parser.add_argument("--device", default="cpu", help="where the model trains and is scored: cpu, cuda")
    parser.add_argument("--merge", type=Path, nargs="+", help="summarize these --json files instead of running")
    args = parser.parse_args()
    if args.merge:
        merged = merge(args.merge)
        print(f"corpus {merged['corpus']}, {merged['rows']} rows x {merged['steps']} steps, seeds {merged['seeds']}")
        summarize(merged["results"], args.baseline)
        write_results(args.json, quality_figures(merged), merged, merged.pop("measured"))
        return
    arms = args.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"no arm {', '.join(sorted(unknown))}; the arms are {', '.join(ARMS)}")
    rows, steps = LENGTHS[args.length]
    rows, steps = args.rows or rows, args.steps or steps
    torch.set_num_threads(args.threads)
    corpus = CORPORA[args.corpus]
    root = make_corpus(corpus)
    docs = train_documents(root)
    sizes = {n: round(sum(len(d) for d in source) / 1e6, 1) for n, source in zip(WEIGHTS, docs)}
    shares = {n: round(long_share(source), 2) for n, source in zip(WEIGHTS, docs)}
    print(
        f"corpus {args.corpus} ({root}): {sizes} M tokens, share in documents of 100k+ tokens {shares}; "
        f"weights {WEIGHTS}; seq_len {SEQ} x rows {rows} x {DP} ranks, {steps} steps "
        f"({DP * rows * SEQ * steps / 1e6:.1f}M tokens), bytes tokenizer, demo TinyGPT on {args.device}, "
        f"seeds {args.seeds}"
    )
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in (int(s) for s in args.seeds.split(",")):
        for arm, figures in run_seed(
            root, docs, arms, rows, steps, seed, args.eval_docs, args.eval_windows, args.device
        ).items():
            results[arm].append(figures)
    if args.baseline in results:
        summarize(results, args.baseline)
    run = {"corpus": args.corpus, "rows": rows, "steps": steps, "dp": DP, "seq_len": SEQ, "seeds": args.seeds}
    run["results"] = results
    write_results(args.json, quality_figures(run), run)


if __name__ == "__main__":
    main()
