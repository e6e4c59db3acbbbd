"""Image-text loading: omniload vs a colocated DataLoader doing the same decode, and balance
with and without the image term of the cost.

Throughput: a generated caption corpus (parquet, a list<binary> column of JPEG photos of
256-640 px, 0-3 per sample, captions of 40-400 bytes). Both sides decode every image with the
same function (omniload.workers.images: RGB, scale to cover 224x224, center crop), put the
same placeholders into byte tokens and pack rows of --seq-len; the same number of worker
processes in all (omniload: --workers W; baseline: W / ranks DataLoader workers per rank,
each rank reading its share of the row groups). Ranks consume as fast as they can until the
job has delivered --images images; the figure is images/s and tokens/s from each rank's first
batch to its last (the slowest rank's time), and the time to the first batch apart. The run
must span several of omniload's shuffle windows (each holds up to 256 MB of pixels, ~1,700
images here), since a window is decoded ahead and then drawn from.

Balance: the planner alone (no processes) on a stream of text documents and image samples,
dp ranks; each step planned once with the image term (d) and once without, and both judged
by the cost with it: max/mean rank cost per step, the median over steps.

    python -m scripts.bench_images [--ranks 2] [--workers 2] [--samples 3000] [--images 6000]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import time
from pathlib import Path

import numpy as np
from torch.utils.data import IterableDataset

from scripts.harness import Figure, add_json_flag, children_import_scripts, write_results

children_import_scripts()  # workers import this module's tokenizers, ranks its loaders

IMAGE_TOKEN, PER_IMAGE, SIZE = 256, 64, 224


def make_corpus(root: Path, samples: int, files: int = 4, seed: int = 0) -> Path:
    """Caption samples with JPEG photos (smooth colour fields with noise, so they compress like
    photos), cached by their parameters."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    folder = root / f"captions-{samples}-{files}-{seed}"
    if (folder / "done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_file = -(-samples // files)
    for f in range(files):
        texts, images = [], []
        for _ in range(min(per_file, samples - f * per_file)):
            count = int(rng.choice(4, p=[0.2, 0.5, 0.2, 0.1]))
            encoded = []
            for _ in range(count):
                w, h = (int(v) for v in rng.integers(256, 641, 2))
                y, x = np.mgrid[0:h, 0:w]
                base = rng.integers(0, 256, 3)
                field = base[None, None, :] + 0.3 * (x[..., None] * rng.random(3) + y[..., None] * rng.random(3))
                pixels = np.clip(field + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
                out = io.BytesIO()
                Image.fromarray(pixels).save(out, format="JPEG", quality=85)
                encoded.append(out.getvalue())
            words = rng.integers(8, 80)
            texts.append(" ".join(f"word{int(k)}" for k in rng.integers(0, 5000, words)))
            images.append(encoded)
        table = pa.table({"text": texts, "image": pa.array(images, pa.list_(pa.binary()))})
        pq.write_table(table, folder / f"part{f}.parquet", row_group_size=64)
    (folder / "done").touch()
    return folder


# -- omniload -------------------------------------------------------------------------------
def _consume(loader, wanted: int, begun: float, tokens_of) -> tuple[int, int, float, float]:
    """(images, tokens, seconds, seconds to the first batch): batches after the first, until
    `wanted` images have come."""
    images = tokens = 0
    started = first = None
    for batch in loader:
        if started is None:
            started = time.perf_counter()
            first = started - begun
            continue
        images += len(batch["pixel_values"])
        tokens += tokens_of(batch)
        if images >= wanted:
            break
    return images, tokens, time.perf_counter() - started, first


def _omniload_rank(addr: str, token: str, rank: int, world: int, wanted: int, out) -> None:
    import omniload

    begun = time.perf_counter()
    loader = omniload.connect(addr, token, rank=rank, world_size=world)
    out.put(_consume(loader, wanted, begun, lambda batch: loader.meta["tokens"]))
    loader.close()


def run_omniload(folder: Path, ranks: int, workers: int, wanted: int, seq_len: int, rows: int) -> tuple:
    import omniload

    spec = {
        "sources": [{"name": "captions", "path": str(folder / "*.parquet"), "image": "image"}],
        "seq_len": seq_len,
        "rows": rows,
        "workers": workers,
        "epochs": 0,
        "image_size": f"{SIZE}x{SIZE}",
        "image_token": IMAGE_TOKEN,
        "tokens_per_image": PER_IMAGE,
        "ring_mb": 16,
    }
    with omniload.Job(spec) as job:
        return _run_ranks(_omniload_rank, [(job.addr, job.token, r, ranks, wanted // ranks) for r in range(ranks)])


# -- colocated DataLoader ---------------------------------------------------------------------
class CaptionStream(IterableDataset):
    """A rank's share of the row groups, each sample decoded and tokenized as omniload's worker
    does, packed greedily into batches of rows x seq_len tokens with their images."""

    def __init__(self, folder: str, rank: int, world: int, seq_len: int, rows: int) -> None:
        self.folder, self.rank, self.world, self.seq_len, self.rows = folder, rank, world, seq_len, rows

    def __iter__(self):
        import pyarrow.parquet as pq
        import torch
        from torch.utils.data import get_worker_info

        from omniload.formats.lane_config import ImageConfig
        from omniload.workers.images import load_image_transform, place_images, text_pieces

        config = ImageConfig(SIZE, SIZE, IMAGE_TOKEN, PER_IMAGE)
        decode = load_image_transform(config)
        info = get_worker_info()
        shard, shards = (
            (self.rank, self.world)
            if info is None
            else (self.rank * info.num_workers + info.id, self.world * info.num_workers)
        )
        groups = [
            (path, g)
            for path in sorted(Path(self.folder).glob("*.parquet"))
            for g in range(pq.ParquetFile(path).num_row_groups)
        ]
        capacity = self.rows * self.seq_len
        tokens, pixels = [], []
        while True:  # epochs forever, as the omniload side
            for path, g in groups[shard::shards]:
                table = pq.ParquetFile(path).read_row_group(g, columns=["text", "image"])
                for text, images in zip(table.column("text").to_pylist(), table.column("image").to_pylist()):
                    pieces = [np.frombuffer(p.encode(), np.uint8).astype(np.int32) for p in text_pieces(text)]
                    ids, _ = place_images(pieces, len(images), config)
                    ids = ids[:capacity]
                    if sum(len(t) for t in tokens) + len(ids) > capacity:
                        yield _collate(tokens, pixels, capacity, torch)
                        tokens, pixels = [], []
                    tokens.append(ids)
                    pixels += [decode(data) for data in images]


def _collate(tokens, pixels, capacity, torch) -> dict:
    flat = np.zeros(capacity, np.int64)
    joined = np.concatenate(tokens)
    flat[: len(joined)] = joined
    stacked = np.stack(pixels) if pixels else np.zeros((0, 3, SIZE, SIZE), np.uint8)
    return {"input_ids": torch.from_numpy(flat), "pixel_values": torch.from_numpy(stacked), "real": len(joined)}


def _colocated_rank(
    folder: str, rank: int, world: int, workers: int, wanted: int, seq_len: int, rows: int, out
) -> None:
    begun = time.perf_counter()
    from scripts.colocated import rank_dataloader

    loader = rank_dataloader(CaptionStream(folder, rank, world, seq_len, rows), workers, prefetch=4)
    out.put(_consume(loader, wanted, begun, lambda batch: batch["real"]))


def run_colocated(folder: Path, ranks: int, workers: int, wanted: int, seq_len: int, rows: int) -> tuple:
    per_rank = max(1, workers // ranks)
    return _run_ranks(
        _colocated_rank, [(str(folder), r, ranks, per_rank, wanted // ranks, seq_len, rows) for r in range(ranks)]
    )


def _run_ranks(target, rank_args: list[tuple]) -> tuple[float, float, float]:
    """Run one process per rank (`target(*args, out)`) and make rates of what they report."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out)) for args in rank_args]
    for p in procs:
        p.start()
    results = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    return _rates(results)


def _rates(results: list[tuple[int, int, float, float]]) -> tuple[float, float, float]:
    """Job-wide images/s and tokens/s (every rank's count over the slowest rank's time), and
    the slowest rank's time to its first batch."""
    seconds = max(r[2] for r in results)
    return sum(r[0] for r in results) / seconds, sum(r[1] for r in results) / seconds, max(r[3] for r in results)


# -- balance --------------------------------------------------------------------------------
def balance(dp: int, rows: int, seq_len: int, steps: int, seed: int = 0) -> dict[str, float]:
    from omniload.coordinator.plan.cost import cost_function
    from omniload.coordinator.plan.packer import Segment
    from omniload.coordinator.plan.step_plan import plan_step
    from omniload.spec import DEFAULT_COST_COEFFS

    rng = np.random.default_rng(seed)
    with_images = cost_function("attention", DEFAULT_COST_COEFFS, ["mix"])
    text_only = cost_function("attention", DEFAULT_COST_COEFFS[:3], ["mix"])
    judged = {"with": [], "without": []}
    sid = 0
    for _ in range(steps):
        fresh, room = [], dp * rows * seq_len
        while room > 0:
            sid += 1
            if rng.random() < 0.5:  # an image sample: a short caption and 1-4 images of 256 placeholders
                count = int(rng.integers(1, 5))
                length = min(seq_len, int(rng.integers(20, 200)) + 256 * count)
            else:  # a text document
                count, length = 0, int(min(seq_len, rng.lognormal(6.5, 1.0)) or 1)
            images = np.zeros((count, 3, 1, 1), np.uint8) if count else None
            fresh.append(Segment(0, sid, length, np.zeros(length, np.int32), images=images))
            room -= length
        for name, cost in (("with", with_images), ("without", text_only)):
            plan = plan_step([], fresh, dp, rows, seq_len, cost)
            per_rank = []
            for rank_rows in plan.rows:
                segments = [s for row in rank_rows for s in row]
                lengths = np.array([s.length for s in segments])
                counts = np.array([s.image_count for s in segments])
                per_rank.append(float(with_images(lengths, np.zeros_like(lengths), counts).sum()))
            judged[name].append(max(per_rank) / float(np.mean(per_rank)))
    return {name: float(np.median(values)) for name, values in judged.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--images", type=int, default=6000, help="Images the job delivers per trial.")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "omniload" / "bench"))
    add_json_flag(parser)
    args = parser.parse_args()

    folder = make_corpus(Path(args.cache), args.samples)
    print(
        f"corpus: {folder} ({sum(p.stat().st_size for p in folder.glob('*.parquet')) / 1e6:.0f} MB), "
        f"ranks={args.ranks}, workers={args.workers} in all, seq_len={args.seq_len}, rows={args.rows}, "
        f"{SIZE}x{SIZE} images, {args.images} images per trial"
    )
    runs = {"omniload": [], "colocated": []}
    for _ in range(args.trials):  # alternated, so drift in the machine hits both alike
        runs["colocated"].append(run_colocated(folder, args.ranks, args.workers, args.images, args.seq_len, args.rows))
        runs["omniload"].append(run_omniload(folder, args.ranks, args.workers, args.images, args.seq_len, args.rows))
    print(f"{'loader':<12}{'images/s':>12}{'tokens/s':>14}{'first batch s':>16}   (median of {args.trials} trials)")
    medians = {}
    for name, trials in runs.items():
        medians[name] = tuple(float(np.median([t[i] for t in trials])) for i in range(3))
        print(f"{name:<12}{medians[name][0]:>12.1f}{medians[name][1]:>14.0f}{medians[name][2]:>16.2f}")
    print(
        f"omniload / colocated: images/s {medians['omniload'][0] / medians['colocated'][0]:.2f}x, "
        f"tokens/s {medians['omniload'][1] / medians['colocated'][1]:.2f}x"
    )

    print("\nbalance, max/mean rank cost judged with the image term (median over 200 steps):")
    print(f"{'dp':>4}{'planned with d':>18}{'planned without d':>20}")
    balanced = {}
    for dp in (8, 32):
        figures = balanced[dp] = balance(dp, rows=4, seq_len=2048, steps=200)
        print(f"{dp:>4}{figures['with']:>18.3f}{figures['without']:>20.3f}")
    ratios = [o[0] / c[0] for o, c in zip(runs["omniload"], runs["colocated"])]  # a trial's sides ran together
    write_results(
        args.json,
        [
            Figure(
                "image-text loading, images/s / the DataLoader",
                f"{medians['omniload'][0] / medians['colocated'][0]:.2f}x"
                + (f" (trials {min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")
                + f"; tokens/s {medians['omniload'][1] / medians['colocated'][1]:.2f}x",
                "forked DataLoader, same decode",
            ),
            Figure(
                "image-text balance, max/mean rank cost with the image term, dp 8 / 32",
                " / ".join(f"{balanced[dp]['with']:.3f}" for dp in balanced)
                + " planned with it; "
                + " / ".join(f"{balanced[dp]['without']:.3f}" for dp in balanced)
                + " without",
                "planned without the image term",
            ),
        ],
        {
            "ranks": args.ranks,
            "workers": args.workers,
            "samples": args.samples,
            "images": args.images,
            "trials": {
                name: [dict(zip(("images_per_s", "tokens_per_s", "first_batch_s"), t)) for t in trials]
                for name, trials in runs.items()
            },
            "balance_max_over_mean": {str(dp): b for dp, b in balanced.items()},
        },
    )


if __name__ == "__main__":
    main()
