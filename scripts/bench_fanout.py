"""Fan-out: one job serving many ranks that pull as fast as they can.

P processes each run R rank clients in threads (world = P x R) against one served job; the
ranks consume batches without a model until the job's --steps end (every rank of a job
consumes the same steps: a rank that stopped early would hold the others). Prints, per world
size: delivered real tokens/s and received MB/s over all ranks, the gap between a rank's
consecutive batches (p50/p99 over every rank), the time until every rank had its first batch,
the coordinator's CPU use while every rank is served and its CPU time per delivered token slot
(coord ns/slot: issue 41's figure, whatever the machine's cores), and the bytes received per
token slot (frames and headers included).

    python -m scripts.bench_fanout [--worlds 16,64,256,1024] [--tokens 100e6] [--procs 8]
                                   [--clients lean|full]

--clients lean (the default) replaces the rank clients by lean consumers (lean_ranks.py): one
selectors loop per process reads many ranks' sockets and acknowledges each batch without
decoding it, so two cores can pull faster than the coordinator sends and the figures are the
coordinator's; tokens/s then counts token slots (padding included). --clients full runs real
rank clients (omniload.connect, a thread each), which are what bound the figures on a small
machine.

Uses only the public API (omniload.Job, omniload.connect), so it runs on older commits too.
Modes (--modes): direct, the coordinator writes to every rank's socket; relayN, every N ranks
share one relay process (`omniload relay`) as the ranks of one node would, over its Unix
socket; sendersN, N sender processes write the batches from the shared step arena.

The worker pool is split by weight once, at its full size (`--autoscale-every 0`): with the
default autoscaling a pool starts at one worker and doubles while sources starve, moving lanes
each time, and on a 16-core machine a 10-second run at 256 ranks then delivered 15.2M token
slots/s against 23.5M with the pool fixed (one run each, 2026-11-26): the runs measured the
pool's growth, not the coordinator. bench_autoscale.py measures the autoscaler.

What it does not show: a real network (loopback only; a relay saves the coordinator
connections and per-connection work, while on one machine it adds a copy on the same cores),
training work on the ranks, and more than this machine's cores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from scripts.harness import Figure, add_json_flag, low_high, write_results


def _ranks(addrs: dict[int, str], token: str, world: int, conn) -> None:
    import socket

    import omniload

    results, received = [], []
    recv_into = socket.socket.recv_into

    def counted(sock, buffer, *args):  # every byte the rank clients receive, headers included
        got = recv_into(sock, buffer, *args)
        received.append(got)
        return got

    socket.socket.recv_into = counted

    def one(rank: int) -> None:
        loader = omniload.connect(addrs[rank], token, rank=rank, world_size=world)
        arrivals, tokens, slots, first = [], 0, 0, None
        for batch in loader:
            now = time.time()
            if first is None:
                first = now
            arrivals.append(now)
            lengths = (batch["cu_seqlens"][1:] - batch["cu_seqlens"][:-1]).numpy()
            tokens += int(lengths[batch["source"].numpy() >= 0].sum())
            slots += batch["input_ids"].numel()
        loader.close()
        results.append({"rank": rank, "first": first, "arrivals": arrivals, "tokens": tokens, "slots": slots})

    threads = [threading.Thread(target=one, args=(r,)) for r in addrs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    conn.send((results, sum(received)))


def _lean_ranks(addrs: dict[int, str], token: str, world: int, conn) -> None:
    from scripts.lean_ranks import consume

    results = consume(addrs, token, world)
    for r in results:
        r["first"] = r["arrivals"][0] if r["arrivals"] else None
        r["tokens"] = r["slots"]  # not decoded: token slots, padding included
    conn.send((results, sum(r["received"] for r in results)))


def _start_relays(job, count: int, folder: str) -> tuple[list[subprocess.Popen], list[str]]:
    relays, addrs = [], []
    for node in range(count):
        path = os.path.join(folder, f"node{node}.sock")
        relays.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "omniload.cli",
                    "relay",
                    "--addr",
                    job.addr,
                    "--token",
                    job.token,
                    "--socket",
                    path,
                ],
                stderr=subprocess.DEVNULL,
            )
        )
        addrs.append(f"unix:{path}")
    deadline = time.monotonic() + 60
    for relay, path in zip(relays, addrs):
        while not os.path.exists(path[len("unix:") :]):
            if relay.poll() is not None or time.monotonic() > deadline:
                _stop(relays)
                raise SystemExit(f"a relay did not start (exit code {relay.poll()})")
            time.sleep(0.05)
    return relays, addrs


def _stop(relays: list[subprocess.Popen]) -> None:
    for relay in relays:
        if relay.poll() is None:
            relay.kill()
        relay.wait()


def _connections(coordinator, addr: str) -> int:
    import psutil

    port = int(addr.rsplit(":", 1)[1])
    return sum(c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED for c in coordinator.net_connections("tcp"))


def run(world: int, procs: int, steps: int, spec: dict, relay_ranks: int = 0, lean: bool = False) -> dict:
    import omniload

    with omniload.Job({**spec, "steps": steps}) as job, tempfile.TemporaryDirectory() as folder:
        relays, addrs = _start_relays(job, -(-world // relay_ranks), folder) if relay_ranks else ([], [job.addr])
        try:
            return _serve_ranks(job, world, min(procs, world), relay_ranks, relays, addrs, lean)
        finally:
            _stop(relays)


def _serve_ranks(
    job, world: int, procs: int, relay_ranks: int, relays: list, addrs: list[str], lean: bool = False
) -> dict:
    import psutil

    ctx = multiprocessing.get_context("spawn")
    coordinator = psutil.Process(job._process.pid)
    senders = [
        p for p in coordinator.children() if "omniload.coordinator.serve.sender_process" in " ".join(p.cmdline())
    ]
    start = time.time()
    pipes, children = [], []
    for p in range(procs):
        receive, send = ctx.Pipe(duplex=False)
        mine = {r: addrs[r // relay_ranks if relay_ranks else 0] for r in range(p, world, procs)}
        child = ctx.Process(target=_lean_ranks if lean else _ranks, args=(mine, job.token, world, send))
        child.start()
        pipes.append(receive)
        children.append(child)
    cpu_samples: list[tuple[float, float, float]] = []
    sampling = threading.Event()

    def sample_cpu() -> None:  # to take the coordinator's CPU over the span every rank is served
        while not sampling.wait(0.25):
            try:
                cpu_samples.append(
                    (time.time(), sum(coordinator.cpu_times()[:2]), sum(sum(p.cpu_times()[:2]) for p in senders))
                )
            except psutil.NoSuchProcess:  # the job ended as the last ranks finished
                return

    sampler = threading.Thread(target=sample_cpu, daemon=True)
    sampler.start()
    while not pipes[0].poll(0.5) and _connections(coordinator, job.addr) < min(world, len(relays) or world):
        pass
    connections = _connections(coordinator, job.addr)
    answers = [receive.recv() for receive in pipes]
    sampling.set()
    sampler.join()
    for child in children:
        child.join()
    for relay in relays:
        relay.wait(30)
    results = [r for rank_results, _ in answers for r in rank_results]
    received = sum(nbytes for _, nbytes in answers)
    gaps = np.concatenate([np.diff(r["arrivals"][1:]) for r in results if len(r["arrivals"]) > 2])
    begin, end = min(r["first"] for r in results), max(r["arrivals"][-1] for r in results)
    served = [sample for sample in cpu_samples if max(r["first"] for r in results) <= sample[0] <= end]
    span = served[-1][0] - served[0][0] if len(served) > 1 else float("nan")
    cpu = (served[-1][1] - served[0][1]) / span if len(served) > 1 else float("nan")
    sender_cpu = (served[-1][2] - served[0][2]) / span if len(served) > 1 else float("nan")
    slots_per_s = sum(r["slots"] for r in results) / (end - begin)
    return {
        "world": world,
        "procs": procs,
        "tokens_per_s": sum(r["tokens"] for r in results) / (end - begin),
        "ns_per_slot": cpu / slots_per_s * 1e9,
        "mb_per_s": received / (end - begin) / 1e6,
        "gap_p50": float(np.percentile(gaps, 50)),
        "gap_p99": float(np.percentile(gaps, 99)),
        "first_batch": max(r["first"] for r in results) - start,
        "cpu": cpu,
        "sender_cpu": sender_cpu,
        "bytes_per_token": received / sum(r["slots"] for r in results),
        "connections": connections,
    }


def main() -> None:
    from scripts.bench_data import make_sources

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="16,64,256,1024")
    parser.add_argument("--tokens", type=float, default=100e6, help="tokens per run (the steps follow from the world)")
    parser.add_argument("--procs", type=int, default=8, help="processes the rank clients are spread over")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument(
        "--modes",
        default="direct,relay8,senders2",
        help="one run each: direct (the coordinator writes to every rank), relayN (N ranks share a "
        "relay), sendersN (N sender processes write the batches)",
    )
    parser.add_argument("--clients", choices=("lean", "full"), default="lean", help="see above")
    parser.add_argument(
        "--autoscale-every",
        type=float,
        default=0.0,
        help="the job's --autoscale-every; 0 (the default here): the pool split by weight once, at its full "
        "size, so that a run of seconds measures the coordinator rather than the pool growing (see above)",
    )
    add_json_flag(parser)
    args = parser.parse_args()
    spec = {
        "sources": make_sources(3, 20000),
        "seq_len": args.seq_len,
        "rows": args.rows,
        "seed": 0,
        "epochs": 0,
        "ring_mb": 4,
        "rank_timeout": 0,
        "autoscale_every": args.autoscale_every,
    }
    print(
        f"machine: {os.cpu_count()} cores; 3 sources, byte tokenizer, seq_len {args.seq_len} x rows {args.rows}, "
        f"about {args.tokens / 1e6:.0f}M tokens a run, {args.procs} client processes, {args.clients} clients"
        + (" (tokens/s: token slots, not decoded)" if args.clients == "lean" else "")
    )
    print(
        f"{'world':>6}{'mode':>10}{'conns':>6}{'tokens/s':>14}{'MB/s':>8}"
        f"{'gap p50':>9}{'gap p99':>9}{'p99/p50':>8}{'1st batch':>10}"
        f"{'coord CPU':>10}{'ns/slot':>8}{'send CPU':>9}{'B/token':>9}"
    )
    runs = []
    for world, mode in ((int(w), m) for w in args.worlds.split(",") for m in args.modes.split(",")):
        steps = max(12, round(args.tokens / (world * args.rows * args.seq_len)))
        relay_ranks = int(mode[len("relay") :]) if mode.startswith("relay") else 0
        senders = int(mode[len("senders") :]) if mode.startswith("senders") else 0
        r = run(world, args.procs, steps, {**spec, "senders": senders}, relay_ranks, args.clients == "lean")
        runs.append({"mode": mode, "steps": steps, **r})
        print(
            f"{world:>6}{mode:>10}{r['connections']:>6}{r['tokens_per_s']:>14,.0f}{r['mb_per_s']:>8.0f}"
            f"{r['gap_p50'] * 1000:>7.0f}ms"
            f"{r['gap_p99'] * 1000:>7.0f}ms{r['gap_p99'] / r['gap_p50']:>8.1f}{r['first_batch']:>9.1f}s"
            f"{r['cpu']:>9.0%}{r['ns_per_slot']:>9.1f}{r['sender_cpu']:>9.0%}{r['bytes_per_token']:>9.2f}",
            flush=True,
        )
    print(
        "ns/slot: the coordinator's CPU time per token slot delivered while every rank was served; "
        "B/token: bytes the rank clients received (frames, headers included) per token slot of their batches; "
        "relayN: N ranks share one relay (`omniload relay`, ranks on its Unix socket); sendersN: N sender "
        "processes write the batches from shared memory; conns: TCP connections the coordinator holds while serving"
    )
    write_results(
        args.json,
        figures_of(runs, args.clients == "lean"),
        {
            "clients": args.clients,
            "tokens": args.tokens,
            "procs": args.procs,
            "seq_len": args.seq_len,
            "rows": args.rows,
            "runs": [{k: None if isinstance(v, float) and v != v else v for k, v in r.items()} for r in runs],
        },
    )


def figures_of(runs: list[dict], lean: bool) -> list[Figure]:
    """The summary rows of these runs: a mode's delivery and coordinator CPU over its worlds, the
    batch gaps at 1,024 ranks, the bytes a token slot at 64, and the whole on a 16-core machine."""
    figures = []
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    rate = "token slots/s" if lean else "tokens/s (full clients)"
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        worlds = " / ".join(f"{r['world']:,}" for r in mine)
        figures.append(
            Figure(
                f"coordinator fan-out, {rate}, {worlds} ranks, {mode}",
                " / ".join(f"{r['tokens_per_s'] / 1e6:.1f}M" for r in mine),
            )
        )
        ns = [r["ns_per_slot"] for r in mine if r["ns_per_slot"] == r["ns_per_slot"]]  # nan: too short to sample
        if ns:
            sampled = [r["world"] for r in mine if r["ns_per_slot"] == r["ns_per_slot"]]
            figures.append(
                Figure(
                    f"the coordinator's CPU a delivered token slot, fan-out, {mode} (issue 41: ≤ 10 ns)",
                    f"{low_high(ns, '.0f')} ns at {low_high(sampled, ',')} ranks",
                )
            )
    at_1024 = [r for r in runs if r["world"] == 1024]
    if at_1024:
        figures.append(
            Figure(
                "batch-gap p99/p50 at 1,024 ranks (≤ 3)",
                ", ".join(f"{r['gap_p99'] / r['gap_p50']:.1f} {r['mode']}" for r in at_1024),
            )
        )
    at_64 = [r for r in runs if r["world"] == 64]
    if at_64:
        figures.append(
            Figure(
                "received bytes a token slot, 64 ranks",
                ", ".join(f"{r['bytes_per_token']:.1f} B {r['mode']}" for r in at_64),
            )
        )
    if lean and len(os.sched_getaffinity(0)) == 16:
        figures.append(
            Figure(
                "coordinator fan-out on 16 cores (≥ 100M)",
                f"{low_high([r['tokens_per_s'] / 1e6 for r in runs], '.1f')}M token slots/s over "
                f"{len(runs)} runs ({', '.join(modes)})",
            )
        )
    return figures


if __name__ == "__main__":
    main()
