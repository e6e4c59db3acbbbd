"""Sustained tokens/s at the ranks: omniload vs the lean colocated DataLoader baseline.

Same files, same tokenizer, same weights. The baseline is what a user writes by hand
(colocated.lean_loader): each rank runs a DataLoader with --workers-per-rank workers over every
source, tokenizing a document when it is taken. omniload runs one job with --workers worker
processes (default: the same total as the baseline's). Ranks consume as fast as they can (no
model), so the figure is the loader's ceiling: the tokens/s it sustains. omniload's ranks
also take what its rings and shuffle windows read ahead during the warm-up, which a run of a
few hundred steps would count as speed (4-18% more at a547722): its figure is the lesser of
what the ranks took and what its workers wrote into their rings meanwhile (the `omniload
taken` column is the former). The tokenizer is real: a byte-level BPE with a
32k vocabulary trained by bench_data.bpe_tokenizer (no download). Two mixes: `bpe` (that
tokenizer everywhere) and `heavy` (one source's transform also normalizes the text and runs a
Python pass over its tokens, as user transforms do).

Besides the ratio, each side's tokens per worker CPU-second is printed next to the
tokenizer's own single-core speed measured in the same run: the share is what the loading
path costs on top of tokenizing (goal: >= 90%, i.e. overhead <= 10%). It is measured at
steady state, from when every rank has taken its warm-up steps to the end: the tokens the
workers produced meanwhile (omniload's: what they wrote into their rings; the baseline's: what
its ranks took) over the CPU time they spent meanwhile. Over the whole run, as before, it also
counted the workers' start (imports, loading the tokenizer) and, for omniload, not what was
left unread in its rings. CPU time, unlike tokens/s, holds on a busy machine.
Processes sharing cores also make fewer tokens per CPU-second (4 on 2 cores time-slice them):
so each trial also times the tokenizer alone in as many processes at once as omniload has
workers (bench_data.tokens_per_cpu_s_together), all of them busy all the time, and prints both
sides' shares against that too (the baseline's against the same figure: with --workers other
than ranks x workers-per-rank its process count differs). A reference for the crowding, not a
target: a job's workers also share the cores with its coordinator and ranks, and now and then
wait on full rings.
Also prints the time to first batch and omniload's delivered bytes/s against a plain
loopback TCP copy measured in the same run.

The peers, MosaicML streaming and LitData (scripts/peers.py: each rank reads every source
with the peer's dataset in a DataLoader of --workers-per-rank workers, tokenizing and packing
as the lean baseline does), run in the `bpe` mix of each trial too, in turn with the two
sides; a peer that is not installed is skipped with a message (pip install mosaicml-streaming
litdata, in a venv of their own: they pull another torch).

    python -m scripts.bench_throughput [--ranks 2] [--workers-per-rank 2] [--workers N] [--steps 1500]
                                       [--tokenizer bpe|bytes] [--trials 3] [--peers streaming,litdata]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import socket
import statistics
import time
from pathlib import Path

import psutil

from scripts.harness import Figure, add_json_flag, children_import_scripts, low_high, write_results

children_import_scripts()  # workers import this module's tokenizers, ranks its loaders

WARMUP_STEPS = 50
_LABELS = {"streaming": "streaming", "litdata": "LitData"}
_PEER_NAMES = {"streaming": "MosaicML streaming", "litdata": "LitData"}


_heavy: dict = {}


def heavy(text: str) -> list[int]:
    """A user's transform around the tokenizer: NFKC-normalize, tokenize, then a Python pass
    over the ids (dropping a reserved one)."""
    import unicodedata

    if "tokenizer" not in _heavy:
        from tokenizers import Tokenizer

        from scripts.bench_data import bpe_tokenizer

        _heavy["tokenizer"] = Tokenizer.from_file(bpe_tokenizer())
    ids = _heavy["tokenizer"].encode(unicodedata.normalize("NFKC", text), add_special_tokens=False).ids
    return [i for i in ids if i != 0]


def _rank(kind: str, spec_dict: dict, rank: int, world: int, steps: int, workers: int, conn, warmed) -> None:
    import torch  # noqa: F401  (a real rank has it imported before the loader starts)

    # each side imports its own loader only: a rank that imported them all would be heavier
    # than users run, and its forked DataLoader workers slower to start
    if kind == "omniload":
        import omniload
    elif kind != "baseline":  # a peer
        from scripts.peers import peer_loader, rank_environment
    else:  # only the baseline's ranks load the readers and the planner
        from omniload.spec import Spec
        from scripts.colocated import lean_loader
    conn.send("ready")
    t0, addr, token = conn.recv()
    if kind == "omniload":
        loader = omniload.connect(addr, token, rank=rank, world_size=world)
    elif kind != "baseline":  # a peer. addr: the folders of its copy of the sources; token: a port to meet at
        rank_environment(rank, world, token)
        sources = spec_dict["sources"]
        weights = [s.get("weight", 1.0) for s in sources]
        rows, seq_len = spec_dict["rows"], spec_dict["seq_len"]
        loader = peer_loader(kind, addr, weights, rows, seq_len, workers, sources[0]["tokenizer"])
    else:
        loader = lean_loader(Spec.from_dict(spec_dict), rank, world, workers)
    batches = iter(loader)

    def real_tokens(batch: dict) -> int:
        if "cu_seqlens" not in batch:  # the lean baseline's rows are all tokens
            return batch["input_ids"].numel()
        lengths = batch["cu_seqlens"][1:] - batch["cu_seqlens"][:-1]
        return int(lengths[batch["source"] >= 0].sum())

    warm = real_tokens(next(batches))
    first_batch = time.time()
    for _ in range(WARMUP_STEPS):  # the first steps drain what was prefetched during startup
        warm += real_tokens(next(batches))
    warmed[rank] = 1
    first = time.time()
    tokens = nbytes = 0
    taken = [(first, warm)]  # (time, tokens taken so far): what the baseline's workers produced by then
    for _ in range(steps):
        batch = next(batches)
        tokens += real_tokens(batch)
        nbytes += sum(t.numel() * t.element_size() for t in batch.values())
        taken.append((time.time(), warm + tokens))
    seconds = time.time() - first
    conn.send(
        {
            "ttfb": first_batch - t0,
            "seconds": seconds,
            "tokens": tokens,
            "all_tokens": warm + tokens,
            "bytes": nbytes,
            "taken": taken,
        }
    )
    conn.recv()  # the bench has read the workers' CPU time: now the workers may go
    if kind == "omniload":
        loader.close()


def _taken_at(taken: list[tuple[float, int]], when: float) -> int:
    """A rank's tokens taken by time `when`, from its (time, tokens so far) after each step."""
    before = [tokens for t, tokens in taken if t <= when]
    return before[-1] if before else taken[0][1]


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def run(
    kind: str, spec_dict: dict, ranks: int, steps: int, workers: int, peer_folders: list[str] | None = None
) -> dict:
    """One side: `workers` is omniload's job total, or the baseline's (a peer's) DataLoader
    workers per rank; a peer reads `peer_folders`."""
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    warmed = ctx.Array("b", ranks)  # each rank has taken its warm-up steps
    for rank in range(ranks):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=_rank, args=(kind, spec_dict, rank, ranks, steps, workers, child, warmed)))
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
    elif kind != "baseline":  # a peer
        from omniload.coordinator.serve.listening import free_port

        addr, token = peer_folders, free_port("127.0.0.1")
    else:
        addr = token = None
    for pipe in pipes:
        pipe.send((t0, addr, token))

    def workers() -> list[int]:
        if job:  # omniload's workers are its forkserver's children
            coordinator = psutil.Process(job._process.pid)
            return [w.pid for server in coordinator.children() for w in server.children()]
        return [c.pid for p in procs for c in psutil.Process(p.pid).children(recursive=True)]

    def written() -> int:  # omniload: the tokens its workers wrote into their rings so far
        return sum(source["tokens_written"] for source in job.status()["sources"]) if job else 0

    while not all(warmed[:]):  # steady state from here: every rank past its warm-up
        time.sleep(0.01)

    def snapshot() -> tuple[float, float, int]:  # (time, the workers' CPU seconds, tokens written), together
        return time.time(), _cpu_seconds(workers()), written()

    started, cpu_before, written_before = snapshot()
    results = [pipe.recv() for pipe in pipes]
    ended, cpu_after, written_after = snapshot()
    cpu = cpu_after - cpu_before
    if job:
        produced = written_after - written_before
    else:  # the DataLoader workers produce what their rank takes (a few batches ahead of it)
        produced = sum(r["all_tokens"] - _taken_at(r["taken"], started) for r in results)
    for pipe in pipes:
        pipe.send("done")
    for proc in procs:
        proc.join()
    if job:
        job.stop()
    if kind == "streaming":
        from scripts.peers import clean_streaming_leftovers

        clean_streaming_leftovers()
    taken = sum(r["tokens"] / r["seconds"] for r in results)
    return {
        # what the loader sustains: omniload's ranks also take what its rings and windows held
        # when the timing began (read ahead during the warm-up), which a short run counts as
        # speed; where its workers wrote fewer tokens meanwhile, their rate is the one that
        # lasts. The baseline's workers produce what its ranks take (a few batches ahead).
        "tokens_per_s": min(taken, produced / (ended - started)) if job else taken,
        "taken_per_s": taken,
        "bytes_per_s": sum(r["bytes"] / r["seconds"] for r in results),
        "ttfb": max(r["ttfb"] for r in results),
        "tokens_per_cpu_s": produced / max(cpu, 1e-9),
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


def main() -> None:  # noqa: PLR0915
    from scripts.bench_data import TIMED_DOCS, bpe_tokenizer, make_sources, tokens_per_cpu_s_together, us_per_token
    from scripts.peers import PEERS, cache_for, convert, missing

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers-per-rank", type=int, default=2, help="the baseline's DataLoader workers per rank")
    parser.add_argument("--workers", type=int, default=0, help="omniload's worker processes (0: the baseline's total)")
    parser.add_argument(
        "--steps", type=int, default=1500, help="timed steps per rank, after 50 warm-up steps (some 10 s a side)"
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--docs", type=int, default=20000, help="documents per source")
    parser.add_argument("--tokenizer", default="bpe", help="bpe (the 32k BPE), bytes, or a tokenizer.json")
    parser.add_argument("--trials", type=int, default=3, help="runs of each side per mix, alternating")
    parser.add_argument("--mixes", default="bpe,heavy", help="the mixes to run, of bpe and heavy")
    parser.add_argument(
        "--peers", default=",".join(PEERS), help="peers to run in the bpe mix where installed ('' for none)"
    )
    parser.add_argument(
        "--shuffle-window",
        type=int,
        default=0,
        help="omniload's --shuffle-window (0: the default). A horizon longer than the corpus reads the "
        "whole corpus before the first batch; a small one with a small --shuffle-fill keeps the planner "
        "reading as it delivers, the steady state of every horizon",
    )
    parser.add_argument("--shuffle-fill", type=int, default=0, help="omniload's --shuffle-fill (0: the default)")
    add_json_flag(parser)
    args = parser.parse_args()
    if unknown := set(args.mixes.split(",")) - {"bpe", "heavy"}:
        parser.error(f"no mix {', '.join(sorted(unknown))}; the mixes are bpe and heavy")
    peers = [p for p in args.peers.split(",") if p]
    if unknown := sorted(set(peers) - set(PEERS)):
        parser.error(f"--peers: unknown {unknown}; pick from {','.join(PEERS)}")
    for peer in list(peers):
        if (why := missing(peer)) is not None:
            print(f"skipping {peer}: {why}")
            peers.remove(peer)
    # one core per worker on every side (omniload's workers set it themselves): the tokenizers
    # library's thread pool in each DataLoader worker would make the baseline heavier than users run it
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    tokenizer = bpe_tokenizer() if args.tokenizer == "bpe" else args.tokenizer
    workers = args.workers or args.ranks * args.workers_per_rank
    sources = [dict(s, tokenizer=tokenizer) for s in make_sources(args.sources, args.docs)]
    # 1 MB rings: omniload's read-ahead (a few dozen steps) stays small beside the timed window
    base = {
        "seq_len": args.seq_len,
        "rows": args.rows,
        "seed": 0,
        "epochs": 0,
        "ring_mb": 1,
        "shuffle_window": args.shuffle_window,
        "shuffle_fill": args.shuffle_fill,
    }
    timed_docs = min(TIMED_DOCS, args.docs)  # a run at the smallest size times the tokenizer on less
    single_core = 1e6 / us_per_token(tokenizer, timed_docs)
    print(
        f"machine: {os.cpu_count()} cores; {args.ranks} ranks; baseline: {args.workers_per_rank} DataLoader "
        f"workers per rank; omniload: {workers} workers; {args.sources} sources, tokenizer {args.tokenizer} "
        f"({single_core:,.0f} tokens per CPU-second on one core, measured now and before each trial); "
        f"seq_len {args.seq_len} x rows {args.rows}, "
        f"{args.steps} steps per rank; {args.trials} trials alternating"
    )
    print(
        f"{'mix':<7}{'trial':>5}{'baseline tok/s':>16}{'omniload tok/s':>16}{'ratio':>7}"
        f"{'tok/worker-cpu-s: baseline':>28}{'omniload':>10}{'ttfb: baseline':>16}{'omniload':>10}"
        f"{'omniload taken':>16}"
    )
    delivered = 0.0
    trials: list[dict] = []  # every side's figures of every trial, for --json
    figures: list[Figure] = []
    for mix in args.mixes.split(","):
        mixed = [dict(s) for s in sources]
        if mix == "heavy":
            mixed[0]["tokenizer"] = "scripts.bench_throughput:heavy"
        spec = dict(base, sources=mixed)
        per_core = mix != "heavy"  # heavy's tokens per CPU-second are not set against the tokenizer's
        # the peers take one tokenizer for every source: the bpe mix only
        mix_peers = peers if mix == "bpe" else []
        folders = {peer: convert(peer, spec, cache_for(sources)) for peer in mix_peers}
        against: dict[str, list[float]] = {peer: [] for peer in mix_peers}
        ratios, shares, their_shares, sustained, references = [], [], [], [], []
        together_shares, their_together_shares, together_references = [], [], []
        for trial in range(1, args.trials + 1):
            # the machine's speed drifts: each trial's workers are set against the tokenizer
            # alone measured right before them, not once for the whole run
            if per_core:
                single_core = 1e6 / us_per_token(tokenizer, timed_docs)
                references.append(single_core)
                together = tokens_per_cpu_s_together(tokenizer, workers, timed_docs)
                together_references.append(together)
            # every side in turn, each trial starting one further along: the machine drifts
            sides = ["baseline", "omniload", *mix_peers]
            order = sides[(trial - 1) % len(sides) :] + sides[: (trial - 1) % len(sides)]
            r = {
                side: run(
                    side,
                    spec,
                    args.ranks,
                    args.steps,
                    workers if side == "omniload" else args.workers_per_rank,
                    folders.get(side),
                )
                for side in order
            }
            ours, theirs = r["omniload"], r["baseline"]
            trials.append(
                {
                    "mix": mix,
                    "trial": trial,
                    **(
                        {"tokenizer_alone_per_cpu_s": single_core, "tokenizer_together_per_cpu_s": together}
                        if per_core
                        else {}
                    ),
                    **{side: dict(r[side]) for side in order},
                }
            )
            delivered = max(delivered, ours["bytes_per_s"])
            ratios.append(ours["tokens_per_s"] / theirs["tokens_per_s"])
            if per_core:
                shares.append(ours["tokens_per_cpu_s"] / single_core)
                their_shares.append(theirs["tokens_per_cpu_s"] / single_core)
                together_shares.append(ours["tokens_per_cpu_s"] / together)
                their_together_shares.append(theirs["tokens_per_cpu_s"] / together)
            sustained.append(ours["tokens_per_s"])
            print(
                f"{mix:<7}{trial:>5}{theirs['tokens_per_s']:>16,.0f}{ours['tokens_per_s']:>16,.0f}{ratios[-1]:>7.2f}"
                f"{theirs['tokens_per_cpu_s']:>28,.0f}{ours['tokens_per_cpu_s']:>10,.0f}"
                f"{theirs['ttfb']:>15.2f}s{ours['ttfb']:>9.2f}s{ours['taken_per_s']:>16,.0f}",
                flush=True,
            )
            for peer in mix_peers:
                against[peer].append(ours["tokens_per_s"] / r[peer]["tokens_per_s"])
                print(
                    f"{'':<7}{'':>5}  {_LABELS[peer]}: {r[peer]['tokens_per_s']:,.0f} tokens/s, omniload / "
                    f"{_LABELS[peer]} {against[peer][-1]:.2f}x; tokens per worker CPU-second "
                    f"{r[peer]['tokens_per_cpu_s']:,.0f}; ttfb {r[peer]['ttfb']:.2f}s",
                    flush=True,
                )
        speed = (
            ""
            if not per_core
            # the baseline's workers share the machine too: their figure says what it costs them
            else f"; per worker CPU-second {statistics.median(shares):.0%} of the tokenizer's single-core speed "
            f"(trials {', '.join(f'{s:.0%}' for s in shares)}), the baseline's "
            f"{statistics.median(their_shares):.0%} (trials {', '.join(f'{s:.0%}' for s in their_shares)}); "
            f"the tokenizer alone {', '.join(f'{r / 1e6:.2f}M' for r in references)} tokens per CPU-second; "
            f"{statistics.median(together_shares):.0%} (trials {', '.join(f'{s:.0%}' for s in together_shares)}) "
            f"of the tokenizer alone in {workers} processes at once "
            f"({', '.join(f'{r / 1e6:.2f}M' for r in together_references)} tokens per CPU-second each), "
            f"the baseline's {statistics.median(their_together_shares):.0%}"
        )
        print(
            f"{mix}: omniload / baseline median {statistics.median(ratios):.2f}x "
            f"(range {min(ratios):.2f}-{max(ratios):.2f}); omniload median "
            f"{statistics.median(sustained) / 1e6:.2f}M tokens/s "
            f"(range {min(sustained) / 1e6:.2f}-{max(sustained) / 1e6:.2f}M){speed}"
        )
        for peer, peer_ratios in against.items():
            print(
                f"{mix}: omniload / {_LABELS[peer]} median {statistics.median(peer_ratios):.2f}x "
                f"(range {min(peer_ratios):.2f}-{max(peer_ratios):.2f})"
            )
        if mix == "bpe":
            figures += _figures(args, workers, [t for t in trials if t["mix"] == mix], against, shares)
    limit = loopback_bytes_per_s()
    print(
        f"omniload's ranks took up to {delivered / 1e6:,.0f} MB/s of batch tensors (read-ahead included; "
        f"the wire carries about a sixth: "
        f"see bench_fanout); plain loopback TCP copy "
        f"{limit / 1e6:,.0f} MB/s ({delivered / limit:.1%} of the limit)"
    )
    write_results(
        args.json,
        figures,
        {
            "ranks": args.ranks,
            "workers_per_rank": args.workers_per_rank,
            "workers": workers,
            "steps": args.steps,
            "sources": args.sources,
            "docs": args.docs,
            "tokenizer": args.tokenizer,
            "shuffle_window": args.shuffle_window,
            "shuffle_fill": args.shuffle_fill,
            "trials": trials,
            "loopback_bytes_per_s": limit,
            "delivered_bytes_per_s": delivered,
        },
    )


def _figures(
    args: argparse.Namespace, workers: int, trials: list[dict], against: dict[str, list[float]], shares: list[float]
) -> list[Figure]:
    """The summary rows of the bpe mix: the ratio to the lean DataLoader, to the peers, the time to
    first batch and the workers' share of the tokenizer's speed."""
    tokenizer = "BPE" if args.tokenizer == "bpe" else f"tokenizer {Path(args.tokenizer).name}"
    ratios = [t["omniload"]["tokens_per_s"] / t["baseline"]["tokens_per_s"] for t in trials]
    over = f"{len(trials)} trial{'s' if len(trials) > 1 else ''}"
    side = (
        f"{workers} workers a side"
        if workers == args.ranks * args.workers_per_rank
        else (f"{workers} workers / {args.ranks * args.workers_per_rank} DataLoader workers")
    )
    cores = len(os.sched_getaffinity(0))
    fill = (
        " ".join(
            f"`--shuffle-{name} {value}`"
            for name, value in (("window", args.shuffle_window), ("fill", args.shuffle_fill))
            if value
        )
        or "default fill"
    )
    figure = (  # the 2-core machine's row, and the lent 16-core machine's
        f"sustained tokens/s, {tokenizer}, {args.ranks} ranks, {side} / the lean DataLoader"
        if cores == 2
        else f"tokens/s, {tokenizer}, {cores} cores, {args.ranks} ranks, {side} / the DataLoader"
    )
    figures = [
        Figure(figure, f"{statistics.median(ratios):.2f}x (trials {low_high(ratios, '.2f')})", "lean DataLoader"),
        Figure(
            f"time to first batch, {args.sources} × {args.docs:,} documents, {tokenizer}, {args.ranks} ranks (≤ 5 s)",
            f"{low_high([t['omniload']['ttfb'] for t in trials], '.1f')} s, {fill}, over {over}",
            f"DataLoader {low_high([t['baseline']['ttfb'] for t in trials], '.1f')} s",
        ),
    ]
    if against:
        figures.append(
            Figure(
                "sustained tokens/s against the peers, same run",
                ", ".join(
                    f"{statistics.median(r):.2f}x {_PEER_NAMES[peer]} (trials {low_high(r, '.2f')})"
                    for peer, r in against.items()
                ),
                "the peers",
            )
        )
    if shares:
        figures.append(
            Figure(
                "worker tokens per CPU-second / the tokenizer alone, in a job (≥ 90%)",
                f"{statistics.median(shares):.0%} (trials {low_high(shares, '.0%')}) "
                "of the tokenizer on one quiet core",
                "the tokenizer alone",
            )
        )
    return figures


if __name__ == "__main__":
    main()
