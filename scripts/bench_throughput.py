"""Delivered tokens/s at the ranks: omniload vs the colocated DataLoader baseline.

Same files, same transforms, same weights, same packing, and the same number of worker
processes in total on both sides (omniload: --workers W for the job; baseline: W / ranks
DataLoader workers per rank). Ranks consume as fast as they can (no model), so the figure
is the loader's ceiling. Two mixes: `cheap` (byte tokenizer everywhere) and
`heterogeneous` (one source's transform costs ten times as much per token). Also prints the
time to first batch and omniload's delivered bytes/s against a plain loopback TCP copy
measured in the same run.

    python scripts/bench_throughput.py [--ranks 2] [--workers 2] [--steps 300]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(HERE))


_WARMUP_STEPS = 50


def costly_bytes(text: str) -> list[int]:
    """The byte tokenizer's work done ten times: a transform ten times as costly per token."""
    for _ in range(10):
        tokens = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    return tokens


def _rank(kind: str, spec_dict: dict, rank: int, world: int, steps: int, workers: int, conn) -> None:
    import torch  # noqa: F401  (a real rank has it imported before the loader starts)

    if kind == "omniload":
        import omniload
    else:  # only the baseline's ranks load the readers and the planner
        from colocated import colocated_loader

        from omniload.spec import Spec
    conn.send("ready")
    t0, addr, token = conn.recv()
    if kind == "omniload":
        loader = omniload.connect(addr, token, rank=rank, world_size=world)
    else:
        loader = colocated_loader(Spec.from_dict(spec_dict), rank, world, workers)
    batches = iter(loader)
    next(batches)
    first_batch = time.time()
    for _ in range(_WARMUP_STEPS):  # the first steps drain what was prefetched during startup
        next(batches)
    first = time.time()
    tokens = nbytes = 0
    for _ in range(steps):
        batch = next(batches)
        lengths = batch["cu_seqlens"][1:] - batch["cu_seqlens"][:-1]
        tokens += int(lengths[batch["source"] >= 0].sum())
        nbytes += sum(t.numel() * t.element_size() for t in batch.values())
    conn.send({"ttfb": first_batch - t0, "seconds": time.time() - first, "tokens": tokens, "bytes": nbytes})
    if kind == "omniload":
        loader.close()


def run(kind: str, spec_dict: dict, ranks: int, steps: int, workers: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for rank in range(ranks):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=_rank, args=(kind, spec_dict, rank, ranks, steps, workers // ranks, child)))
        procs[-1].start()
        pipes.append(parent)
    for pipe in pipes:
        assert pipe.recv() == "ready"
    job = None
    t0 = time.time()
    if kind == "omniload":
        import omniload

        job = omniload.Job(dict(spec_dict, workers=workers)).start()
        addr, token = job.addr, job.token
    else:
        addr = token = None
    for pipe in pipes:
        pipe.send((t0, addr, token))
    results = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join()
    if job:
        job.stop()
    return {
        "tokens_per_s": sum(r["tokens"] / r["seconds"] for r in results),
        "bytes_per_s": sum(r["bytes"] / r["seconds"] for r in results),
        "ttfb": max(r["ttfb"] for r in results),
    }


def loopback_bytes_per_s(total: int = 2 << 30, chunk: int = 1 << 20) -> float:
    """A plain TCP copy over loopback between two processes: this machine's limit."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        sock = socket.create_connection(("127.0.0.1", port))
        data = bytes(chunk)
        for _ in range(total // chunk):
            sock.sendall(data)
        sock.close()
        os._exit(0)
    conn, _ = server.accept()
    buffer = bytearray(chunk)
    started, received = time.perf_counter(), 0
    while (got := conn.recv_into(buffer)) > 0:
        received += got
    seconds = time.perf_counter() - started
    os.waitpid(pid, 0)
    conn.close()
    server.close()
    return received / seconds


def main() -> None:
    from bench_data import make_sources

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="worker processes in total, on each side")
    parser.add_argument("--steps", type=int, default=600, help="timed steps per rank, after 50 warm-up steps")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--docs", type=int, default=20000, help="documents per source")
    args = parser.parse_args()

    sources = make_sources(args.sources, args.docs)
    # 1 MB rings: omniload's read-ahead (a few dozen steps) stays small beside the timed window
    base = {"seq_len": args.seq_len, "rows": args.rows, "seed": 0, "epochs": 0, "ring_mb": 1}
    print(
        f"machine: {os.cpu_count()} cores; {args.ranks} ranks, {args.workers} worker processes per side, "
        f"{args.sources} sources, seq_len {args.seq_len} x rows {args.rows}, {args.steps} steps per rank"
    )
    print(
        f"{'mix':<14}{'baseline tok/s':>16}{'omniload tok/s':>16}{'ratio':>8}{'baseline ttfb':>15}{'omniload ttfb':>15}"
    )
    delivered = 0.0
    for mix in ("cheap", "heterogeneous"):
        mixed = [dict(s) for s in sources]
        if mix == "heterogeneous":
            mixed[0]["tokenizer"] = "bench_throughput:costly_bytes"
        spec = dict(base, sources=mixed)
        baseline = run("baseline", spec, args.ranks, args.steps, args.workers)
        ours = run("omniload", spec, args.ranks, args.steps, args.workers)
        delivered = max(delivered, ours["bytes_per_s"])
        print(
            f"{mix:<14}{baseline['tokens_per_s']:>16,.0f}{ours['tokens_per_s']:>16,.0f}"
            f"{ours['tokens_per_s'] / baseline['tokens_per_s']:>8.2f}"
            f"{baseline['ttfb']:>14.2f}s{ours['ttfb']:>14.2f}s"
        )
    limit = loopback_bytes_per_s()
    print(
        f"omniload handed out {delivered / 1e6:,.0f} MB/s of batch tensors (the wire carries about a sixth: "
        f"see bench_fanout); plain loopback TCP copy "
        f"{limit / 1e6:,.0f} MB/s ({delivered / limit:.1%} of the limit)"
    )


if __name__ == "__main__":
    main()
