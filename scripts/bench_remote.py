"""Delivered tokens/s and time to first batch reading the bench corpus from an S3 endpoint on
loopback at several round trips, against the same files on local disk, in the same run.

The store is moto's server (tests/s3_store.MotoServer); in front of it, one FaultyProxy per
round trip holds each request `rtt` ms before the store sees it (0 ms still goes through the
proxy). The corpus is bench_throughput's (bench_data.make_sources), uploaded once per run.
Each run is bench_throughput.run: 2 ranks consuming as fast as they can, after 50 warm-up
steps. The sides alternate: every remote run is bracketed by local runs (L R0 L R20 L R50 L
R100 L per round), and each ratio is the remote run over the mean of the two local runs
beside it, so the machine's drift cancels. The tokenizer is a real byte-level BPE (32k
vocabulary, trained once on the Python standard library's sources with the `tokenizers`
library), its measured cost per token printed; `--tokenizer bytes` uses the byte tokenizer.

Peers (MosaicML streaming, LitData) read their own copy of the same documents (peers.convert)
uploaded to the same store, through the proxy at `--peer-rtts`, tokenizing with the same BPE
in their DataLoader workers. Each is skipped with a message where it cannot be imported
(they are benchmark-only: pip install mosaicml-streaming litdata, e.g. in a separate venv).

    python -m scripts.bench_remote [--rtts 0,20,50,100] [--rounds 3] [--steps 200] [--peer-rtts 50]

Not shown: a real network (the store and the proxy share the 2 cores with the loader, and
moto serves from memory); memory of the read-ahead and the cache.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench_data import CACHE, bpe_tokenizer, make_sources, us_per_token
from scripts.bench_throughput import WARMUP_STEPS, run
from scripts.harness import Figure, add_json_flag, children_import_scripts, min_median_max, write_results

children_import_scripts()  # the spawned peers import the baselines

BUCKET = "bench"


def upload(store, folders: dict[str, Path]) -> None:
    """Every file of every source folder at BUCKET/<name>/..., put with 8 threads."""
    from concurrent.futures import ThreadPoolExecutor

    client = store.client()
    client.create_bucket(Bucket=BUCKET)
    files = [
        (f"{name}/{p.relative_to(root).as_posix()}", p)
        for name, root in folders.items()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    ]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kp: client.put_object(Bucket=BUCKET, Key=kp[0], Body=kp[1].read_bytes()), files))


def remote_spec(spec: dict, endpoint: str) -> dict:
    """The same sources, read from the store through `endpoint`."""
    sources = [
        dict(s, path=f"s3://{BUCKET}/{s['name']}/{Path(s['path']).name}", endpoint=endpoint) for s in spec["sources"]
    ]
    return dict(spec, sources=sources)


# ---- peers: their own copy of the documents, uploaded to the same store, read through the proxy


def _peer_rank(
    peer: str,
    urls: list[str],
    weights: list[float],
    spec: dict,
    rank: int,
    world: int,
    steps: int,
    workers: int,
    port: int,
    env: dict,
    conn,
) -> None:
    import sysconfig

    # spawn gives the child the parent's sys.path: torch, numpy and pyarrow are imported from it
    # (the project's), then the peer interpreter's own packages go first, so the peers and what
    # they pin (transformers' tokenizers) come from there
    import numpy  # noqa: F401
    import pyarrow  # noqa: F401
    import torch  # noqa: F401

    sys.path.insert(0, sysconfig.get_paths()["purelib"])
    from scripts.colocated import rank_dataloader
    from scripts.peers import Packed, clean_streaming_leftovers, rank_environment, stub_torchvision

    if rank == 0:
        clean_streaming_leftovers()
    os.environ.update(env)
    rank_environment(rank, world, port)
    cache = tempfile.mkdtemp(prefix=f"bench-remote-{peer}-")  # a cold local cache each run
    conn.send("ready")
    t0, _, _ = conn.recv()

    if peer == "streaming":
        stub_torchvision()
        from streaming import Stream, StreamingDataset

        streams = [Stream(remote=u, local=f"{cache}/{i}") for i, u in enumerate(urls)]
        dataset = StreamingDataset(streams=streams, shuffle=True, shuffle_seed=0, batch_size=1, replication=None)
    else:
        from litdata import CombinedStreamingDataset, StreamingDataset
        from litdata.streaming import downloader
        from litdata.streaming.resolver import Dir

        # LitData 0.2.76 builds its obstore client without allow_http, so a plain http endpoint
        # fails ("builder error"); its boto3 path (the one it falls back to) reads it
        downloader._OBSTORE_AVAILABLE = False

        options = {"endpoint_url": env["AWS_ENDPOINT_URL"]}
        total = sum(weights)
        dataset = CombinedStreamingDataset(
            [
                StreamingDataset(
                    input_dir=Dir(path=f"{cache}/{i}", url=u), shuffle=True, seed=0, storage_options=options
                )
                for i, u in enumerate(urls)
            ],
            weights=[w / total for w in weights],
            iterate_over_all=False,
            seed=0,
        )
    packed = Packed(_Tokenized(dataset, spec["sources"][0]["tokenizer"]), spec["rows"], spec["seq_len"])
    batches = iter(rank_dataloader(packed, workers))
    next(batches)
    first_batch = time.time()
    for _ in range(WARMUP_STEPS):
        next(batches)
    first = time.time()
    tokens = 0
    for _ in range(steps):
        tokens += next(batches)["input_ids"].numel()
    conn.send({"ttfb": first_batch - t0, "seconds": time.time() - first, "tokens": tokens, "bytes": 0})


class _Tokenized:
    """A peer's items, their text replaced by the same transform omniload's workers apply."""

    def __init__(self, inner, tokenizer: str) -> None:  # noqa: ANN001
        self.inner, self.tokenizer = inner, tokenizer

    def __iter__(self):  # noqa: ANN204
        from omniload.workers.transforms import load_transform

        transform = load_transform(self.tokenizer)
        for item in self.inner:
            yield {"text": transform([item["text"]])[0]}


def run_peer(
    peer: str, urls: list[str], spec: dict, ranks: int, steps: int, workers: int, env: dict, python: str
) -> dict:
    """bench_throughput.run's shape, for a peer's ranks (run by `python`, where the peer is installed)."""
    from multiprocessing import spawn

    ctx = multiprocessing.get_context("spawn")
    spawn.set_executable(python)
    try:
        return _run_peer(ctx, peer, urls, spec, ranks, steps, workers, env)
    finally:
        spawn.set_executable(sys.executable)


def _run_peer(
    ctx,
    peer: str,
    urls: list[str],
    spec: dict,
    ranks: int,
    steps: int,
    workers: int,  # noqa: ANN001
    env: dict,
) -> dict:
    from omniload.coordinator.serve.listening import free_port

    weights = [s.get("weight", 1.0) for s in spec["sources"]]
    port = free_port("127.0.0.1")
    pipes, procs = [], []
    for rank in range(ranks):
        parent, child = ctx.Pipe()
        procs.append(
            ctx.Process(
                target=_peer_rank,
                args=(peer, urls, weights, spec, rank, ranks, steps, workers // ranks, port, env, child),
            )
        )
        procs[-1].start()
        pipes.append(parent)
    for pipe in pipes:
        assert pipe.recv() == "ready"
    t0 = time.time()
    for pipe in pipes:
        pipe.send((t0, None, None))
    results = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return {"tokens_per_s": sum(r["tokens"] / r["seconds"] for r in results), "ttfb": max(r["ttfb"] for r in results)}


_CONVERT = """
import json, sys
from scripts.peers import convert, missing
peer, spec, cache = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
why = missing(peer)
print(json.dumps({"why": why, "folders": None if why else convert(peer, spec, __import__("pathlib").Path(cache))}))
"""


def peer_urls(peer: str, spec: dict, store, python: str) -> list[str] | None:
    """The peer's copy of the sources, converted once (peers.convert, run by `python`, where
    the peer is installed) and uploaded; None (and a message) where the peer cannot run."""
    import json
    import subprocess

    done = subprocess.run(
        [python, "-c", _CONVERT, peer, json.dumps(spec), str(CACHE / "peers-remote")],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    if done.returncode != 0:
        print(f"skipping {peer}: converting its copy failed: {done.stderr.strip()[-500:]}")
        return None
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if answer["why"] is not None:
        print(f"skipping {peer} ({python}): {answer['why']}")
        return None
    folders = [Path(f) for f in answer["folders"]]
    upload(store, {f"{peer}/{f.name}": f for f in folders})
    return [f"s3://{BUCKET}/{peer}/{f.name}" for f in folders]


def main() -> None:  # noqa: PLR0915
    from tests.s3_store import CREDENTIALS, FaultyProxy, MotoServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtts", default="0,20,50,100", help="round trips in ms, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of L R0 L R20 ... L")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="worker processes in total")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per rank, after 50 warm-up steps")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--docs", type=int, default=20000, help="documents per source")
    parser.add_argument("--tokenizer", default="bpe", help="'bpe' (a real byte-level BPE), 'bytes', or a path")
    parser.add_argument("--peer-rtts", default="50", help="round trips the peers read at ('' for none)")
    parser.add_argument(
        "--shuffle-window",
        type=int,
        default=512,
        help="segments; small, so the timed steps read the store rather than drain the first window",
    )
    parser.add_argument("--peers", default="streaming,litdata")
    parser.add_argument(
        "--peer-python",
        default=os.environ.get("PEER_PYTHON", sys.executable),
        help="the interpreter that has the peers installed (their ranks run under it)",
    )
    parser.add_argument("--read-ahead", type=int, default=0, help="bytes per lane; 0: the job's default")
    add_json_flag(parser)
    args = parser.parse_args()

    tokenizer = bpe_tokenizer() if args.tokenizer == "bpe" else args.tokenizer
    rtts = [int(r) for r in args.rtts.split(",") if r]
    peer_rtts = [int(r) for r in args.peer_rtts.split(",") if r]
    sources = [dict(s, tokenizer=tokenizer) for s in make_sources(args.sources, args.docs)]
    spec = {
        "seq_len": args.seq_len,
        "rows": args.rows,
        "seed": 0,
        "epochs": 0,
        "ring_mb": 1,
        "sources": sources,
        "shuffle_window": args.shuffle_window,
    }
    if args.read_ahead:
        spec["read_ahead"] = args.read_ahead
    os.environ.update(CREDENTIALS)  # the coordinator and its workers inherit them
    store = MotoServer()
    proxies = {rtt: FaultyProxy(store.port, delay_s=rtt / 1000) for rtt in sorted(set(rtts + peer_rtts))}
    try:
        upload(store, {s["name"]: Path(s["path"]).parent for s in sources})
        cost = us_per_token(tokenizer)
        print(
            f"machine: {os.cpu_count()} cores; {args.ranks} ranks, {args.workers} worker processes, "
            f"{args.sources} sources x {args.docs} documents, seq_len {args.seq_len} x rows {args.rows}, "
            f"{args.steps} timed steps per rank, shuffle window {args.shuffle_window} segments; "
            f"tokenizer {Path(tokenizer).name} ({cost:.2f} us/token here, "
            f"one process); store: moto on loopback behind a proxy holding each request RTT ms; "
            f"{args.rounds} rounds of L " + " ".join(f"R{r} L" for r in rtts)
        )
        local: list[dict] = []
        remote: dict[int, list[tuple[dict, float]]] = {rtt: [] for rtt in rtts}
        for round_ in range(args.rounds):
            order = rtts if round_ % 2 == 0 else rtts[::-1]  # the RTTs swap places each round
            before = run("omniload", spec, args.ranks, args.steps, args.workers)
            local.append(before)
            for rtt in order:
                ours = run("omniload", remote_spec(spec, proxies[rtt].endpoint), args.ranks, args.steps, args.workers)
                after = run("omniload", spec, args.ranks, args.steps, args.workers)
                local.append(after)
                ratio = ours["tokens_per_s"] / ((before["tokens_per_s"] + after["tokens_per_s"]) / 2)
                remote[rtt].append((ours, ratio))
                print(
                    f"round {round_ + 1}: R{rtt}: {ours['tokens_per_s']:,.0f} tok/s, ttfb {ours['ttfb']:.2f}s; "
                    f"local beside it {before['tokens_per_s']:,.0f} / {after['tokens_per_s']:,.0f} tok/s; "
                    f"ratio {ratio:.3f}",
                    flush=True,
                )
                before = after
        peers: dict[tuple[str, int], list[dict]] = {}
        for peer in [p for p in args.peers.split(",") if p] if peer_rtts else ():
            urls = peer_urls(peer, {k: v for k, v in spec.items() if k != "read_ahead"}, store, args.peer_python)
            for rtt in peer_rtts if urls else ():
                # AWS_ALLOW_HTTP: LitData's obstore client refuses a plain http endpoint without it
                env = {
                    "S3_ENDPOINT_URL": proxies[rtt].endpoint,
                    "AWS_ENDPOINT_URL": proxies[rtt].endpoint,
                    "AWS_ALLOW_HTTP": "true",
                    "LITDATA_ASYNC_CHUNK_PREFETCH": "0",
                }
                for _ in range(args.rounds):
                    try:
                        got = run_peer(peer, urls, spec, args.ranks, args.steps, args.workers, env, args.peer_python)
                    except Exception as exc:  # a peer that fails on this store is reported, not fatal
                        print(f"{peer} at {rtt} ms failed: {type(exc).__name__}: {exc}")
                        break
                    peers.setdefault((peer, rtt), []).append(got)
                    print(f"{peer} R{rtt}: {got['tokens_per_s']:,.0f} tok/s, ttfb {got['ttfb']:.2f}s", flush=True)

        print(
            f"\n{'side':<22}{'runs':>5}{'tokens/s min/median/max':>36}{'ttfb s min/median/max':>26}"
            f"{'remote/local min/median/max':>30}"
        )
        rows = [("local disk", local, None)] + [
            (f"s3, {rtt} ms RTT", [o for o, _ in remote[rtt]], [r for _, r in remote[rtt]]) for rtt in rtts
        ]
        rows += [(f"{peer}, s3 {rtt} ms", got, None) for (peer, rtt), got in peers.items()]
        for name, got, ratios in rows:
            print(
                f"{name:<22}{len(got):>5}{min_median_max([g['tokens_per_s'] for g in got], ',.0f'):>36}"
                f"{min_median_max([g['ttfb'] for g in got], '.2f'):>26}"
                f"{min_median_max(ratios, '.3f') if ratios else '':>30}"
            )
        for (peer, rtt), got in peers.items():
            ours = statistics.median(o["tokens_per_s"] for o, _ in remote.get(rtt, [])) if rtt in remote else None
            if ours:
                print(
                    f"omniload at {rtt} ms / {peer} at {rtt} ms (medians): "
                    f"{ours / statistics.median(g['tokens_per_s'] for g in got):.2f}x"
                )
        # the summary's row is the 32k BPE's at 50 ms: other settings' figures are rows of their own
        of = "" if args.tokenizer == "bpe" else f", tokenizer {Path(args.tokenizer).name}"
        figures = [
            Figure(
                f"S3 at {rtt} ms round trip / local disk, tokens/s{of}" + (" (≥ 0.9)" if rtt == 50 else ""),
                f"{statistics.median(ratios):.3f}"
                + (f" ({min(ratios):.3f}-{max(ratios):.3f})" if len(ratios) > 1 else "")
                + f" over {len(ratios)} round{'s' if len(ratios) > 1 else ''}",
                "the same files on disk, bracketing",
            )
            for rtt in rtts
            if (ratios := [r for _, r in remote[rtt]])
        ]
        write_results(
            args.json,
            figures,
            {
                "ranks": args.ranks,
                "workers": args.workers,
                "steps": args.steps,
                "sources": args.sources,
                "docs": args.docs,
                "tokenizer": args.tokenizer,
                "shuffle_window": args.shuffle_window,
                "us_per_token": cost,
                "local": local,
                "remote": {str(rtt): [{**o, "ratio": r} for o, r in got] for rtt, got in remote.items()},
                "peers": {f"{peer}, {rtt} ms": got for (peer, rtt), got in peers.items()},
            },
        )
    finally:
        for proxy in proxies.values():
            proxy.close()
        store.stop()


if __name__ == "__main__":
    main()
