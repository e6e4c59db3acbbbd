"""Delivered tokens/s with one source ten times costlier per token: autoscaled vs static split.

Same files, same transforms, same budget of worker processes on both sides: `static` is
`--workers B` (split by weight once, so the costly source gets what its weight says);
`auto` is `--workers auto` with `--reserve-cpus` set so that its budget is the same B, and
the split follows each source's measured cost. K sources of equal weight; every source's
transform does the same per-token work (a few rounds of integer arithmetic over its byte
tokens), the first source ten times as many rounds. One rank consumes as fast as it can;
the figure is delivered tokens/s over the timed window (from the job's status), and the
split (workers per source) is sampled every second to show how it moved.

    python scripts/bench_autoscale.py [--budget 2] [--sources 4] [--seconds 30]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(HERE))

_ROUNDS = 40  # the cheap sources' per-token work; the costly one does ten times as many rounds


def _work(text: str, rounds: int) -> np.ndarray:
    tokens = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    mixed = tokens.copy()
    for _ in range(rounds):  # per-token CPU work that cannot be skipped
        mixed = (mixed * 1103515245 + 12345) & 0x7FFFFFFF
    return tokens if mixed.sum() >= 0 else mixed


def cheap(text: str) -> np.ndarray:
    return _work(text, _ROUNDS)


def costly(text: str) -> np.ndarray:
    return _work(text, 10 * _ROUNDS)


def _rank(addr: str, token: str) -> None:
    import omniload

    for _ in omniload.connect(addr, token, rank=0, world_size=1):
        pass


def run(spec_dict: dict, seconds: float, warmup: float) -> tuple[float, list[str]]:
    """Delivered tokens/s over `seconds` after `warmup`, and the split sampled each second."""
    import omniload

    job = omniload.Job(spec_dict).start()
    rank = multiprocessing.get_context("spawn").Process(target=_rank, args=(job.addr, job.token), daemon=True)
    rank.start()
    names = [s["name"] for s in spec_dict["sources"]]
    splits: list[str] = []
    try:
        started = time.monotonic()
        first = None
        while (now := time.monotonic()) < started + warmup + seconds:
            time.sleep(1.0)
            status = job.status()
            split = "/".join(str(s["workers"]) for s in status["sources"])
            if not splits or splits[-1].split(" ", 1)[1] != split:
                splits.append(f"{now - started:.0f}s {split}")
            if first is None and now - started >= warmup:
                first = (time.monotonic(), status["delivered"]["tokens"])
        last = (time.monotonic(), job.status()["delivered"]["tokens"])
    finally:
        rank.kill()
        rank.join()
        job.stop()
    del names
    return (last[1] - first[1]) / (last[0] - first[0]), splits


def main() -> None:
    from bench_data import make_sources

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=2, help="worker processes on each side")
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0, help="timed window per run")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before the window (auto measures, "
                                                                    "then moves)")
    parser.add_argument("--every", type=float, default=3.0, help="auto: --autoscale-every")
    parser.add_argument("--docs", type=int, default=20000, help="documents per source")
    args = parser.parse_args()

    sources = make_sources(args.sources, args.docs)
    for i, source in enumerate(sources):
        source["tokenizer"] = "bench_autoscale:costly" if i == 0 else "bench_autoscale:cheap"
    base = {"sources": sources, "seq_len": 2048, "rows": 4, "seed": 0, "epochs": 0, "ring_mb": 1}
    cpus = len(os.sched_getaffinity(0))
    print(f"machine: {cpus} cores; {args.sources} sources of equal weight, source s0 ten times costlier per token; "
          f"{args.budget} worker processes on each side; one rank as fast as it can; "
          f"{args.warmup:.0f}s warm-up, {args.seconds:.0f}s timed")
    static, static_split = run(dict(base, workers=args.budget), args.seconds, args.warmup)
    auto, auto_split = run(dict(base, workers="auto", reserve_cpus=cpus - args.budget, autoscale_every=args.every),
                           args.seconds, args.warmup)
    print(f"{'split':<10}{'tokens/s':>12}   workers per source ({'/'.join(s['name'] for s in sources)}) over time")
    print(f"{'static':<10}{static:>12,.0f}   {', '.join(static_split)}")
    print(f"{'auto':<10}{auto:>12,.0f}   {', '.join(auto_split)}")
    print(f"autoscaled / static: {auto / static:.2f}x")


if __name__ == "__main__":
    main()
