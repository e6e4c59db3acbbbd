"""Total loader memory as ranks grow: omniload vs a plain per-rank DataLoader and two peers.

N real rank processes (e.g. 1, 2, 4, 8, 16) over K sources (4 and 16), each rank consuming at
the same fixed rate (10 steps/s) on every side, each side doing the same read, byte-tokenize
and pack on the same files:

- `dataloader`: the lean colocated baseline (colocated.lean_loader), what a user writes by
  hand: each rank runs a DataLoader with W workers over every source, reading a row group at a
  time and tokenizing a document when it is taken.
- `streaming` (MosaicML) and `litdata` (Lightning): the same documents converted once into the
  peer's format in the cache, each rank reading them with the peer's dataset in a DataLoader
  with W workers (peers.py). Skipped with a message where the peer is not installed.
- `planned`: the older baseline that runs omniload's planner and packer in every worker
  (colocated.colocated_loader, used by the throughput benchmark); heavier than what users run,
  so it is off unless asked for with --kinds.
- `omniload`: one coordinator with its default `--workers auto` (this host's CPUs less one;
  `OMNILOAD_CPUS=16` sizes it as on a 16-core node), or min(K, N*W, --omniload-workers N).

Every side tokenizes with the same tokenizer (--tokenizer: the 32k BPE of bench_data by
default; a real vocabulary is part of what each process holds).

Memory is PSS summed over every process of the loading stack (ranks and their DataLoader
workers; coordinator, forkserver, workers), sampled at steady state while batches flow,
minus the PSS of N bare `import torch` rank processes measured the same way, so every side
counts only what loading adds.

    [OMNILOAD_CPUS=16] python -m scripts.bench_memory [--ranks 1,2,4,8,16] [--sources 4,16]
        [--workers-per-rank 2] [--omniload-workers auto|N] [--tokenizer bpe|bytes]
        [--kinds dataloader,streaming,litdata,omniload]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

import psutil

from omniload.coordinator.serve.listening import free_port  # noqa: E402
from scripts.harness import Figure, add_json_flag, write_results
from scripts.peers import PEERS, cache_for, clean_streaming_leftovers, convert, missing  # noqa: E402

_KINDS = ("dataloader", "streaming", "litdata", "planned", "omniload")
_LABELS = {"dataloader": "DataLoader", "streaming": "streaming", "litdata": "LitData", "planned": "planned"}
_PEER_NAMES = {"streaming": "streaming", "litdata": "LitData"}  # as the summary table names them
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
    elif kind in PEERS:
        from scripts.peers import peer_loader, rank_environment

        rank_environment(rank, world, token)
        loader = peer_loader(
            kind,
            addr,
            [s.get("weight", 1.0) for s in spec_dict["sources"]],
            spec_dict["rows"],
            spec_dict["seq_len"],
            workers,
            spec_dict["sources"][0].get("tokenizer", "bytes"),
        )
    else:  # only the baselines' ranks load the readers (and, planned, the planner)
        from omniload.spec import Spec
        from scripts.colocated import colocated_loader, lean_loader

        make = lean_loader if kind == "dataloader" else colocated_loader
        loader = make(Spec.from_dict(spec_dict), rank, world, workers)
    started = time.monotonic()
    for step, _ in enumerate(loader, start=1):
        progress[rank] = step
        time.sleep(max(0.0, started + step / _RATE - time.monotonic()))


def pss(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def pids_by_role(coordinator: int) -> dict[str, list[int]]:
    """omniload's processes by role: the forkserver and resource tracker are the coordinator's
    children, the workers the forkserver's (forked from it, so they share its command line)."""
    roles: dict[str, list[int]] = {"coordinator": [coordinator], "forkserver": [], "tracker": [], "workers": []}
    try:
        for child in psutil.Process(coordinator).children():
            line = " ".join(child.cmdline())
            if "forkserver" in line:
                roles["forkserver"].append(child.pid)
                roles["workers"] += [c.pid for c in child.children(recursive=True)]
            elif "resource_tracker" in line:
                roles["tracker"].append(child.pid)
    except psutil.NoSuchProcess:
        pass
    return roles


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
    mb = pss([p.pid for p in procs])
    for p in procs:
        p.kill()
        p.join()
    return mb


def loading_mb(  # noqa: C901, PLR0912  (one branch a kind of loader)
    kind: str,
    spec_dict: dict,
    n: int,
    workers_per_rank: int,
    omniload_workers: str = "auto",
    peer_folders: list[str] | None = None,
    breakdown: dict | None = None,
    settle: float = 0.0,
) -> float:
    """Mean PSS of the loading stack in MB, sampled `settle` seconds after every rank reached
    _WARM_STEPS; for omniload, `breakdown` gets its processes' PSS by role."""
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

        workers = (
            0
            if omniload_workers == "auto"
            else min(len(spec_dict["sources"]), n * workers_per_rank, int(omniload_workers))
        )
        job = omniload.Job(dict(spec_dict, workers=workers)).start()
        addr, token = job.addr, job.token
    else:  # a peer's ranks get the folders of its copy of the sources, and a port to meet at
        addr, token = peer_folders, free_port("127.0.0.1")
    for pipe in pipes:
        pipe.send((addr, token))
    deadline = time.monotonic() + 120 + 30 * n  # 16 ranks starting a peer on 2 cores take minutes
    while min(progress[:]) < _WARM_STEPS:
        dead = [p.exitcode for p in procs if not p.is_alive()]
        if time.monotonic() > deadline or dead:
            raise RuntimeError(
                f"{kind}: ranks did not reach step {_WARM_STEPS}: {progress[:]}"
                + (f"; ranks exited with codes {dead} (their error is above)" if dead else "")
            )
        time.sleep(0.2)
    settled = time.monotonic() + settle  # --workers auto grows and shrinks its pool every 5 s
    while time.monotonic() < settled:
        if dead := [p.exitcode for p in procs if not p.is_alive()]:
            raise RuntimeError(f"{kind}: ranks exited with codes {dead} while settling (their error is above)")
        time.sleep(0.2)
    samples = []
    began, done = time.monotonic(), min(progress[:])
    for _ in range(_SAMPLES):
        pids = [pid for p in procs for pid in _tree(p.pid)] + (_tree(job._process.pid) if job else [])
        samples.append(pss(pids))
        time.sleep(_SAMPLE_GAP_S)
    rate = (min(progress[:]) - done) / (time.monotonic() - began)
    if rate < 0.9 * _RATE:  # a loader that falls behind holds less in flight: its figure flatters it
        print(
            f"  ({kind} at N={n}: the slowest rank ran {rate:.1f} steps/s while measured, not {_RATE:.0f}: "
            "the loader did not keep up)",
            flush=True,
        )
    if job and breakdown is not None:
        for role, pids in pids_by_role(job._process.pid).items():
            breakdown[role] = pss(pids) if role != "workers" else [round(pss([pid])) for pid in pids]
    for p in procs:
        for pid in reversed(_tree(p.pid)):
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        p.join()
    if job:
        job.stop()
    if kind == "streaming":
        clean_streaming_leftovers()
    return sum(samples) / len(samples)


def main() -> None:
    from omniload.coordinator.pool.worker_pool import available_cpus
    from scripts.bench_data import bpe_tokenizer, make_sources

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,4,8,16")
    parser.add_argument("--sources", default="4,16")
    parser.add_argument("--workers-per-rank", type=int, default=2)
    parser.add_argument(
        "--omniload-workers",
        default="auto",
        help="omniload's workers: auto (the job default) or a budget N (at most N*W)",
    )
    parser.add_argument("--tokenizer", default="bpe", help="every side's tokenizer: bpe (32k), bytes, or a path")
    parser.add_argument("--docs", type=int, default=6000, help="documents per source")
    parser.add_argument("--median-bytes", type=int, default=1200)
    parser.add_argument(
        "--kinds", default="dataloader,streaming,litdata,omniload", help=f"what to measure, of {','.join(_KINDS)}"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=40.0,
        help="seconds every side runs at its pace after the warm-up before memory is sampled (steady "
        "state: --workers auto decides every 5 s whether to grow or shrink its pool)",
    )
    add_json_flag(parser)
    args = parser.parse_args()
    # one core per worker on every side (omniload's workers set it themselves): the tokenizers
    # library's thread pool in each DataLoader worker would make the baseline heavier than users run it
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ranks = [int(n) for n in args.ranks.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; pick from {','.join(_KINDS)}")
    for peer in [k for k in kinds if k in PEERS]:
        if (why := missing(peer)) is not None:
            print(f"skipping {peer}: {why}")
            kinds.remove(peer)
    others = [k for k in kinds if k != "omniload"]
    tokenizer = bpe_tokenizer() if args.tokenizer == "bpe" else args.tokenizer
    budget = (
        f"--workers auto ({available_cpus()} CPUs{' from OMNILOAD_CPUS' if os.environ.get('OMNILOAD_CPUS') else ''})"
        if args.omniload_workers == "auto"
        else f"min(K, N*W, {args.omniload_workers}) workers in total"
    )
    print(
        f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
        f"{_RATE:.0f} steps/s per rank; {args.workers_per_rank} DataLoader workers per rank for "
        f"{', '.join(_LABELS[k] for k in others) or 'no baseline'}; omniload {budget}; tokenizer "
        f"{args.tokenizer}; MB = PSS of the loading stack minus bare torch ranks, {args.settle:.0f} s after "
        f"step {_WARM_STEPS}"
    )
    bare = {n: bare_torch_mb(n) for n in ranks}
    measured: list[dict] = []  # a row a (sources, ranks): each side's MB, for --json
    for k in (int(k) for k in args.sources.split(",")):
        # two files per source, row groups / record batches of 1000 documents (~1.5 MB of text)
        sources = make_sources(k, args.docs, median_bytes=args.median_bytes, files_per_source=2)
        sources = [dict(s, tokenizer=tokenizer) for s in sources]
        spec = {"sources": sources, "seq_len": 1024, "rows": 2, "seed": 0, "epochs": 0}
        folders = {peer: convert(peer, spec, cache_for(sources)) for peer in kinds if peer in PEERS}
        print(f"\nK={k} sources")
        header = "".join(f"{_LABELS.get(kind, kind) + ' MB':>15}" for kind in kinds)
        ratios = "".join(f"{'vs ' + _LABELS[kind]:>15}" for kind in others) if "omniload" in kinds else ""
        print(f"{'N':>4}{header}{ratios}")
        first = last = None
        roles: dict[int, dict] = {}
        for n in ranks:
            roles[n] = {}
            mb = {
                kind: loading_mb(
                    kind,
                    spec,
                    n,
                    args.workers_per_rank,
                    args.omniload_workers,
                    folders.get(kind),
                    roles[n],
                    args.settle,
                )
                - bare[n]
                for kind in kinds
            }
            measured.append({"sources": k, "ranks": n, "mb": mb, "omniload_processes_mb": roles[n]})
            line = "".join(f"{mb[kind]:>15,.0f}" for kind in kinds)
            if "omniload" in kinds:
                line += "".join(f"{mb[kind] / mb['omniload']:>14.1f}x" for kind in others)
                first, last = first or mb["omniload"], mb["omniload"]
            print(f"{n:>4}{line}", flush=True)
        if first:
            print(f"omniload at N={ranks[-1]} / at N={ranks[0]}: {last / first:.2f}x")
            print(
                "omniload's processes, PSS MB: "
                + "; ".join(
                    f"N={n}: coordinator {r['coordinator']:.0f}, forkserver {r['forkserver']:.0f}, "
                    f"tracker {r['tracker']:.0f}, workers {r['workers']}"
                    for n, r in roles.items()
                    if r
                )
            )
    write_results(
        args.json,
        figures_of(measured),
        {
            "workers_per_rank": args.workers_per_rank,
            "omniload_workers": args.omniload_workers,
            "tokenizer": args.tokenizer,
            "docs": args.docs,
            "settle_s": args.settle,
            "bare_torch_mb": bare,
            "rows": measured,
        },
    )


def figures_of(measured: list[dict]) -> list[Figure]:
    """The summary rows: a source count's memory against the lean DataLoader, and against the
    peers, at each rank count (their MB over omniload's)."""
    figures = []
    for k in dict.fromkeys(row["sources"] for row in measured):
        rows = [row["mb"] for row in measured if row["sources"] == k and "omniload" in row["mb"]]
        if not rows:
            continue
        at = " / ".join(str(row["ranks"]) for row in measured if row["sources"] == k)

        def times(kind: str, rows: list[dict] = rows) -> list[str]:
            return [f"{mb[kind] / mb['omniload']:.1f}x" for mb in rows]

        if "dataloader" in rows[0]:
            ours = " / ".join(f"{mb['omniload']:,.0f}" for mb in rows)
            theirs = " / ".join(f"{mb['dataloader']:,.0f}" for mb in rows)
            figures.append(
                Figure(
                    f"loader memory / the lean DataLoader, {k} sources"
                    + (" (≥ 5x at 8 ranks, ≥ 15x at 16)" if k == 16 else ""),
                    f"{' / '.join(times('dataloader'))} at {at} ranks ({ours} MB against {theirs} MB)",
                    "lean DataLoader",
                )
            )
        if peers := [peer for peer in PEERS if peer in rows[0]]:
            figures.append(
                Figure(
                    f"loader memory against the peers, {at} ranks" + ("" if k == 16 else f", {k} sources"),
                    ", ".join(f"{' / '.join(times(peer))} less than {_PEER_NAMES[peer]}" for peer in peers),
                    "the peers",
                )
            )
    return figures


if __name__ == "__main__":
    main()
