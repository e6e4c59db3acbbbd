"""Total loader memory as ranks grow: omniload vs the colocated DataLoader baseline.

N real rank processes (1, 2, 4, 8, 16) over K sources (4 and 16), each rank consuming at the
same fixed rate (10 steps/s) on both sides. Baseline: each rank runs a DataLoader with W
workers over every source. omniload: one coordinator with min(K, N*W, --omniload-workers)
workers in total, never more than the baseline: its worker count follows what the data needs
(here 16 ranks at 10 steps/s need ~330k tokens/s), not the number of ranks. Each source's files have multi-MB row groups, so its
file-access state (row-group buffer, token arrays, the index) is several MB.

Memory is PSS summed over every process of the loading stack (ranks and their DataLoader
workers; coordinator, forkserver, workers), sampled at steady state while batches flow,
minus the PSS of N bare `import torch` rank processes measured the same way, so both sides
count only what loading adds.

    python scripts/bench_memory.py [--ranks 1,2,4,8,16] [--sources 4,16] [--workers-per-rank 2]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
_RATE = 10.0  # steps per second per rank
_WARM_STEPS = 20
_SAMPLES, _SAMPLE_GAP_S = 3, 0.7


def _bare_rank(ready) -> None:
    import torch  # noqa: F401

    ready.set()
    time.sleep(3600)


def _rank(kind: str, spec_dict: dict, rank: int, world: int, workers: int, conn, progress) -> None:
    import torch  # noqa: F401

    import omniload

    conn.send("ready")
    addr, token = conn.recv()
    if kind == "omniload":
        loader = omniload.connect(addr, token, rank=rank, world_size=world)
    else:  # only the baseline's ranks load the readers and the planner
        from colocated import colocated_loader

        from omniload.spec import Spec

        loader = colocated_loader(Spec.from_dict(spec_dict), rank, world, workers)
    started = time.monotonic()
    for step, _ in enumerate(loader, start=1):
        progress[rank] = step
        time.sleep(max(0.0, started + step / _RATE - time.monotonic()))


def _pss(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def _tree(pid: int) -> list[int]:
    try:
        process = psutil.Process(pid)
        return [pid] + [c.pid for c in process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def bare_torch_mb(n: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    events = [ctx.Event() for _ in range(n)]
    procs = [ctx.Process(target=_bare_rank, args=(e,)) for e in events]
    for p in procs:
        p.start()
    for e in events:
        e.wait(120)
    time.sleep(0.5)
    mb = _pss([p.pid for p in procs])
    for p in procs:
        p.kill()
        p.join()
    return mb


def loading_mb(kind: str, spec_dict: dict, n: int, workers_per_rank: int, omniload_workers: int = 4) -> float:
    ctx = multiprocessing.get_context("spawn")
    progress = ctx.Array("l", n)
    pipes, procs = [], []
    for rank in range(n):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=_rank, args=(kind, spec_dict, rank, n, workers_per_rank, child, progress)))
        procs[-1].start()
        pipes.append(parent)
    for pipe in pipes:
        assert pipe.recv() == "ready"
    job = None
    if kind == "omniload":
        import omniload

        workers = min(len(spec_dict["sources"]), n * workers_per_rank, omniload_workers)
        job = omniload.Job(dict(spec_dict, workers=workers)).start()
        addr, token = job.addr, job.token
    else:
        addr = token = None
    for pipe in pipes:
        pipe.send((addr, token))
    deadline = time.monotonic() + 120
    while min(progress[:]) < _WARM_STEPS:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{kind}: ranks did not reach step {_WARM_STEPS}: {progress[:]}")
        time.sleep(0.2)
    samples = []
    for _ in range(_SAMPLES):
        pids = [pid for p in procs for pid in _tree(p.pid)] + (_tree(job._process.pid) if job else [])
        samples.append(_pss(pids))
        time.sleep(_SAMPLE_GAP_S)
    for p in procs:
        for pid in reversed(_tree(p.pid)):
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        p.join()
    if job:
        job.stop()
    return sum(samples) / len(samples)


def main() -> None:
    from bench_data import make_sources

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,4,8,16")
    parser.add_argument("--sources", default="4,16")
    parser.add_argument("--workers-per-rank", type=int, default=2)
    parser.add_argument("--omniload-workers", type=int, default=4, help="omniload's worker budget (at most N*W)")
    parser.add_argument("--docs", type=int, default=6000, help="documents per source")
    parser.add_argument("--median-bytes", type=int, default=1200)
    args = parser.parse_args()
    ranks = [int(n) for n in args.ranks.split(",")]
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          f"{_RATE:.0f} steps/s per rank; baseline {args.workers_per_rank} DataLoader workers per rank; "
          f"omniload min(K, N*W, {args.omniload_workers}) workers in total; "
          "MB = PSS of the loading stack minus bare torch ranks")
    bare = {n: bare_torch_mb(n) for n in ranks}
    for k in (int(k) for k in args.sources.split(",")):
        # one row group per file half: 3000 rows of ~1.2 KB, a few MB of text per row group
        sources = make_sources(k, args.docs, median_bytes=args.median_bytes, files_per_source=2)
        spec = {"sources": sources, "seq_len": 1024, "rows": 2, "seed": 0, "epochs": 0}
        print(f"\nK={k} sources")
        print(f"{'N':>4}{'baseline MB':>14}{'omniload MB':>14}{'ratio':>8}")
        first = None
        for n in ranks:
            base = loading_mb("baseline", spec, n, args.workers_per_rank) - bare[n]
            ours = loading_mb("omniload", spec, n, args.workers_per_rank, args.omniload_workers) - bare[n]
            first = first or ours
            print(f"{n:>4}{base:>14,.0f}{ours:>14,.0f}{base / ours:>8.1f}", flush=True)
        print(f"omniload at N={ranks[-1]} / at N={ranks[0]}: {ours / first:.2f}x")


if __name__ == "__main__":
    main()
