"""What a model sees: omniload's batches against a global shuffle of random windows.

Corpus (heavy-tailed lengths, written once into a cache folder, 5% of each source's documents
held out). Nothing in it depends on what the machine has installed:
  code        parquet      this Python's standard library .py files (up to 250 x seq_len each):
                           part of every Python install, the same for a given Python version
  docs        JSON lines   package documentation generated from a seed (quality_corpus.py)
  changelogs  Arrow IPC    Debian-style changelogs generated from a seed (quality_corpus.py)
Files are written in sorted path order, so a reader that takes documents in file order sees
one package or one module family at a time.

Arms, each feeding the demo's tiny GPT the same number of steps with the same seed:
  reference   every seq_len window of each source's token stream in a seeded random order,
              rows given to sources by the weights (Megatron's blended GPTDataset)
  omniload    a real job (coordinator, workers, rings, TCP) with the default window, cap
              and interleave, read by DP clients in this process
  window-256  the same job with --shuffle-window 256 (a few global batches' worth)
  no-window   the same job with --shuffle-window 1 --max-doc-share 1 --shard-interleave 1:
              documents in reading order, as before the shuffle window existed

Printed per arm: per-step and 10-step mixture error (max |share - weight|, percentage
points), distinct documents per rank-batch (mean, p10) and in the whole run, the longest run
of consecutive steps in which one document is more than half of a rank's tokens, held-out
loss after training (on plain windows and on whole documents), and for omniload the time to
the first batch and the loader position's size (a rank's state_dict, JSON bytes).

    python scripts/bench_quality.py [--steps 200] [--seeds 0,1,2] [--arms reference,omniload]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

import omniload
from omniload.demo.train import VOCAB, TinyGPT
from omniload.state import RANK_KEY

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_corpus  # noqa: E402

# v2: docs and changelogs generated (v1 read the installed packages' docs and /usr/share/doc)
CACHE = Path.home() / ".cache" / "omniload" / "quality-v2"
WEIGHTS = {"code": 0.5, "docs": 0.3, "changelogs": 0.2}
SEQ, ROWS, DP = 256, 4, 2
_MAX_DOC_BYTES = 250 * SEQ
_HOLDOUT = 20  # one document in this many is held out
_CORPUS_SEED = 20261124
_DOCS_PACKAGES, _CHANGELOG_PACKAGES = 950, 5000  # about 9 MB and 24 MB, as the v1 corpus had


# -- corpus -----------------------------------------------------------------------------------
def _texts() -> dict[str, list[tuple[str, str]]]:
    """(path, text) per source, in sorted path order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = []
    for path in sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts):
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")[:_MAX_DOC_BYTES]
        except OSError:
            continue
        if len(text) >= 16:
            code.append((str(path.relative_to(stdlib)), text))
    return {
        "code": code,
        "docs": quality_corpus.docs(_CORPUS_SEED, _DOCS_PACKAGES, _MAX_DOC_BYTES),
        "changelogs": quality_corpus.changelogs(_CORPUS_SEED + 1, _CHANGELOG_PACKAGES, _MAX_DOC_BYTES),
    }


def make_corpus() -> Path:
    if (CACHE / ".complete").exists():
        return CACHE
    for name, docs in _texts().items():
        train = [t for p, t in docs if int(hashlib.md5(p.encode()).hexdigest(), 16) % _HOLDOUT]
        held = [t for p, t in docs if not int(hashlib.md5(p.encode()).hexdigest(), 16) % _HOLDOUT]
        folder = CACHE / name
        folder.mkdir(parents=True, exist_ok=True)
        (CACHE / f"{name}.heldout.json").write_text(json.dumps(held))
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
    (CACHE / ".complete").touch()
    return CACHE


def _spec(root: Path, steps: int, seed: int, **extra) -> dict:
    paths = {"code": "code/*.parquet", "docs": "docs/*.jsonl", "changelogs": "changelogs/*.arrow"}
    return {
        "sources": [{"name": n, "path": str(root / paths[n]), "weight": w} for n, w in WEIGHTS.items()],
        "seq_len": SEQ,
        "rows": ROWS,
        "seed": seed,
        "epochs": 0,
        "steps": steps,
        "workers": 2,
        **extra,
    }


def _encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)


# -- the arms: each yields steps of DP rank batches -------------------------------------------
@dataclass
class RankBatch:
    input_ids: np.ndarray  # [ROWS, SEQ]
    labels: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    seg_source: np.ndarray  # per segment: source index, -1 for padding
    seg_doc: np.ndarray  # per segment: document id, -1 for padding
    seg_len: np.ndarray


def omniload_steps(root: Path, steps: int, seed: int, figures: dict | None = None, **extra) -> list[list[RankBatch]]:
    out, state_bytes = [], []
    started = time.perf_counter()
    with omniload.Job(_spec(root, steps, seed, **extra)) as job:
        env = job.env()
        clients = [
            omniload.connect(env["OMNILOAD_ADDR"], env["OMNILOAD_TOKEN"], rank=r, world_size=DP) for r in range(DP)
        ]
        for batches in zip(*clients):
            if not out and figures is not None:
                figures["first_batch_s"] = time.perf_counter() - started
            state_bytes.append(len(clients[0].state_dict()[RANK_KEY]))
            step = []
            for b in batches:
                cu = b["cu_seqlens"].numpy().astype(np.int64)
                step.append(
                    RankBatch(
                        b["input_ids"].numpy().copy(),
                        b["labels"].numpy().copy(),
                        b["position_ids"].numpy().copy(),
                        cu,
                        b["source"].numpy().copy(),
                        np.where(b["sample_id"].numpy() >= 0, b["sample_id"].numpy() >> 12, -1),
                        np.diff(cu),
                    )
                )
            out.append(step)
        for client in clients:
            client.close()
    if figures is not None:
        figures.update(state_median=float(np.median(state_bytes)), state_max=max(state_bytes))
    return out


def reference_steps(root: Path, steps: int, seed: int) -> list[list[RankBatch]]:
    """Seeded random windows of each source's token stream; rows to sources by the weights."""
    from omniload.formats.shards import detect_format
    from omniload.workers.readers import index_file, read_shard

    streams, offsets, windows = [], [], []
    for s, name in enumerate(WEIGHTS):
        texts = []
        for path in sorted((root / name).iterdir()):
            if detect_format(str(path)):
                texts += [
                    v
                    for shard in index_file(str(path), detect_format(str(path)), "text", 0)
                    for v in read_shard(shard, "text")
                ]
        tokens = [_encode(t) for t in texts]
        streams.append(np.concatenate(tokens))
        offsets.append(np.concatenate([[0], np.cumsum([len(t) for t in tokens])]))
        count = len(streams[-1]) // SEQ
        windows.append(np.random.default_rng([seed, s]).permutation(count))
    weights = np.array(list(WEIGHTS.values()))
    drawn, used = np.zeros(len(weights)), [0] * len(weights)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(DP):
            rows, sources, docs, lens = [], [], [], []
            for _ in range(ROWS):
                s = int(np.argmin((drawn + 1) / weights))  # stride scheduling by rows
                drawn[s] += 1
                start = int(windows[s][used[s] % len(windows[s])]) * SEQ
                used[s] += 1
                rows.append(streams[s][start : start + SEQ])
                first, last = np.searchsorted(offsets[s], [start, start + SEQ], side="right") - 1
                for d in range(first, min(last, len(offsets[s]) - 2) + 1):
                    overlap = min(offsets[s][d + 1], start + SEQ) - max(offsets[s][d], start)
                    if overlap > 0:
                        sources.append(s)
                        docs.append(s << 40 | d)
                        lens.append(overlap)
            ids = np.stack(rows)
            labels = np.concatenate([ids[:, 1:], np.full((ROWS, 1), -100)], axis=1)
            step.append(
                RankBatch(
                    ids,
                    labels,
                    np.tile(np.arange(SEQ), (ROWS, 1)),
                    np.arange(0, ROWS * SEQ + 1, SEQ),
                    np.array(sources),
                    np.array(docs),
                    np.array(lens),
                )
            )
        out.append(step)
    return out


# -- what the batches hold --------------------------------------------------------------------
def batch_figures(steps: list[list[RankBatch]]) -> dict[str, float]:
    weights = np.array(list(WEIGHTS.values()))
    shares, distinct, runs = [], [], []
    run = np.zeros(DP, dtype=int)
    for step in steps:
        tokens = np.zeros(len(weights))
        for r, b in enumerate(step):
            real = b.seg_source >= 0
            np.add.at(tokens, b.seg_source[real], b.seg_len[real])
            docs, per_doc = np.unique(b.seg_doc[real], return_inverse=True)
            distinct.append(len(docs))
            doc_tokens = np.bincount(per_doc, weights=b.seg_len[real])
            run[r] = run[r] + 1 if doc_tokens.max() > 0.5 * b.seg_len[real].sum() else 0
            runs.append(run[r])
        shares.append(tokens)
    shares = np.array(shares)
    per_step = np.abs(shares / shares.sum(1, keepdims=True) - weights).max(1) * 100
    tens = shares[: len(shares) // 10 * 10].reshape(-1, 10, len(weights)).sum(1)
    per_ten = np.abs(tens / tens.sum(1, keepdims=True) - weights).max(1) * 100
    return {
        "step_err_mean": per_step.mean(),
        "step_err_max": per_step.max(),
        "ten_err_max": per_ten.max(initial=0.0),
        "distinct_mean": float(np.mean(distinct)),
        "distinct_p10": float(np.percentile(distinct, 10)),
        "longest_run": int(max(runs)),
        "docs_in_run": len({int(d) for step in steps for b in step for d in b.seg_doc if d >= 0}),
    }


# -- training and held-out loss ---------------------------------------------------------------
def _loss(model: TinyGPT, ids: np.ndarray, positions: np.ndarray, cu: np.ndarray, labels: np.ndarray) -> torch.Tensor:
    logits = model(torch.from_numpy(ids).long(), torch.from_numpy(positions).long(), torch.from_numpy(cu).long())
    return F.cross_entropy(logits.view(-1, VOCAB), torch.from_numpy(labels).long().view(-1), ignore_index=-100)


def train(steps: list[list[RankBatch]], seed: int) -> TinyGPT:
    """DP ranks' gradients averaged, as DDP does: the mean of each rank's mean loss."""
    torch.manual_seed(seed)
    model = TinyGPT(SEQ)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in steps:
        loss = sum(_loss(model, b.input_ids, b.position_ids, b.cu_seqlens, b.labels) for b in step) / len(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model


def heldout_sets(root: Path, seed: int, rows_per_source: int = 96) -> dict[str, list[tuple]]:
    """Per source, batches of held-out rows two ways: plain windows of the concatenated held-out
    documents (attention across document boundaries), and whole documents (one per segment)."""
    sets: dict[str, list[tuple]] = {"windows": [], "documents": []}
    rng = np.random.default_rng([seed, 99])
    for s, name in enumerate(WEIGHTS):
        docs = [_encode(t) for t in json.loads((root / f"{name}.heldout.json").read_text())]
        stream = np.concatenate(docs)
        starts = rng.choice(len(stream) // SEQ, rows_per_source, replace=False) * SEQ
        for i in range(0, rows_per_source, ROWS):
            ids = np.stack([stream[a : a + SEQ] for a in starts[i : i + ROWS]])
            labels = np.concatenate([ids[:, 1:], np.full((ROWS, 1), -100)], axis=1)
            sets["windows"].append(
                (s, ids, np.tile(np.arange(SEQ), (ROWS, 1)), np.arange(0, ROWS * SEQ + 1, SEQ), labels)
            )
        chunks = [d[a : a + SEQ] for d in docs for a in range(0, len(d), SEQ)]
        picked = [chunks[i] for i in rng.choice(len(chunks), rows_per_source, replace=False)]
        for i in range(0, rows_per_source, ROWS):
            ids = np.zeros((ROWS, SEQ), dtype=np.int64)
            labels = np.full((ROWS, SEQ), -100)
            positions = np.tile(np.arange(SEQ), (ROWS, 1))
            cu = [0]
            for r, chunk in enumerate(picked[i : i + ROWS]):
                ids[r, : len(chunk)] = chunk
                labels[r, : len(chunk) - 1] = chunk[1:]
                cu += [r * SEQ + len(chunk)] + ([(r + 1) * SEQ] if len(chunk) < SEQ else [])
            sets["documents"].append((s, ids, positions, np.array(cu), labels))
    return sets


@torch.no_grad()
def heldout_loss(model: TinyGPT, batches: list[tuple]) -> float:
    """The mixture-weighted mean of each source's loss."""
    per_source: dict[int, list[float]] = {}
    for s, ids, positions, cu, labels in batches:
        loss = _loss(model, ids, positions, cu, labels)
        per_source.setdefault(s, []).append(float(loss))
    return sum(w * np.mean(per_source[s]) for s, w in enumerate(WEIGHTS.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--arms",
        default="reference,omniload,window-256,no-window",
        help="which arms to run (reference always runs: the others are measured against it)",
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    root = make_corpus()
    sizes = {n: sum(f.stat().st_size for f in (root / n).iterdir()) >> 20 for n in WEIGHTS}
    print(
        f"corpus {root}: {sizes} MB (train files); weights {WEIGHTS}; seq_len {SEQ} x rows {ROWS}, "
        f"{DP} ranks, {args.steps} steps, bytes tokenizer, demo TinyGPT, seeds {args.seeds}"
    )
    arms = {
        "reference": lambda steps, seed, figures: reference_steps(root, steps, seed),
        "omniload": lambda steps, seed, figures: omniload_steps(root, steps, seed, figures),
        "window-256": lambda steps, seed, figures: omniload_steps(root, steps, seed, figures, shuffle_window=256),
        "no-window": lambda steps, seed, figures: omniload_steps(
            root, steps, seed, figures, shuffle_window=1, max_doc_share=1.0, shard_interleave=1
        ),
    }
    wanted = {"reference", *args.arms.split(",")}
    unknown = wanted - set(arms)
    if unknown:
        parser.error(f"no arm {', '.join(sorted(unknown))}; the arms are {', '.join(arms)}")
    arms = {arm: make for arm, make in arms.items() if arm in wanted}
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in (int(s) for s in args.seeds.split(",")):
        evals = heldout_sets(root, seed)
        for arm, make in arms.items():
            started = time.perf_counter()
            figures: dict = {}
            steps = make(args.steps, seed, figures)
            figures.update(batch_figures(steps))
            model = train(steps, seed)
            figures.update(
                loss_windows=heldout_loss(model, evals["windows"]),
                loss_documents=heldout_loss(model, evals["documents"]),
            )
            results[arm].append(figures)
            print(
                f"  seed {seed} {arm:<10} held-out loss {figures['loss_windows']:.3f} (windows) "
                f"{figures['loss_documents']:.3f} (documents)  [{time.perf_counter() - started:.0f}s]",
                flush=True,
            )
    print()
    print(
        f"{'arm':<11}{'step err pp':>12}{'max':>6}{'10-step max':>12}{'docs/rank-batch':>16}{'p10':>5}"
        f"{'docs in run':>12}{'longest run':>12}{'loss windows':>13}{'loss docs':>10}{'1st batch':>10}"
        f"{'state B med/max':>16}"
    )
    for arm, rows in results.items():
        mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        omni = (
            f"{mean['first_batch_s']:>9.1f}s{mean['state_median']:>9.0f}/{max(r['state_max'] for r in rows):<6}"
            if "first_batch_s" in mean
            else ""
        )
        print(
            f"{arm:<11}{mean['step_err_mean']:>12.1f}{max(r['step_err_max'] for r in rows):>6.1f}"
            f"{max(r['ten_err_max'] for r in rows):>12.1f}{mean['distinct_mean']:>16.1f}{mean['distinct_p10']:>5.1f}"
            f"{mean['docs_in_run']:>12.0f}{max(r['longest_run'] for r in rows):>12d}{mean['loss_windows']:>13.3f}"
            f"{mean['loss_documents']:>10.3f}{omni}"
        )
    ref = {k: float(np.mean([r[k] for r in results["reference"]])) for k in ("loss_windows", "loss_documents")}
    for arm in list(results)[1:]:
        gap = {k: float(np.mean([r[k] for r in results[arm]])) - v for k, v in ref.items()}
        print(
            f"{arm} - reference held-out loss: {gap['loss_windows']:+.3f} nats (windows), "
            f"{gap['loss_documents']:+.3f} nats (documents)"
        )


if __name__ == "__main__":
    main()
