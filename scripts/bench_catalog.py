"""Catalogs at scale: time from launch to the first batch for a source of N small objects in an
S3 bucket on loopback, without and with the cached catalog, and the coordinator's memory for
the catalog per object.

The store is moto's server (tests/s3_store.MotoServer). The bucket holds N one-line JSON lines
objects of about 60 bytes under `data/<folder>/`, `--folders` folders (the catalog lists each
top folder in its own thread), put with 32 boto3 threads. The source is
`s3://<bucket>/data/*/*.jsonl`.

- cold: omniload.Job with a fresh --cache-dir, started, and one rank (omniload.connect in this
  process) pulling its first batch: listing, indexing every object (one GET each) and the first
  slices. The job keeps its catalog in <cache-dir>/catalogs.
- cached: the same spec and the first cold launch's cache dir again, `--rounds` times: the
  catalog is read from there, not listed. (Before 2026-11-28 each cached round but the first
  made its catalog with a cold launch of its own that printed nothing: what looked like a
  cached launch without a batch after 60 s at 10,000 objects was that silent cold launch.)
- memory: tracemalloc around build_catalog(spec) in this process, the result held: the bytes
  of Python objects the coordinator keeps for the catalog (its indexing child's are not
  counted: it exits), divided by N; also the catalog file's bytes per object.
- moto's own rates in the same run, with boto3: a sequential listing (keys/s) and GETs with
  16 threads (objects/s), to show where the store itself bounds the figures.
- `--rtt-ms R`: the job reaches moto through a proxy that holds each request R ms (a round
  trip; the issue's 25 ms each way is 50), and each launch prints the requests it made by kind.
- `--shuffle-window W --shuffle-fill F` (in seq_len segments of 256 tokens, as the CLI's): the
  jobs' shuffle. At the defaults the first batch waits for the whole bucket to be read (the
  fill, 2**27 tokens, is longer than the epoch); these objects hold some 15 tokens each, so even
  a fill of 256 segments is thousands of objects, and with the default horizon (2**28 tokens)
  almost no unit is due before the epoch's end.
  `--shuffle-window 16 --shuffle-fill 4` (1,024 tokens, some 70 objects) shows the start alone.
- `--against COMMIT`: the cached launches alternate between this checkout and COMMIT's tree (a
  temporary git worktree on PYTHONPATH, which the coordinator and its workers inherit) on the
  same bucket and kept catalog, this checkout first in odd rounds, COMMIT first in even ones.

    python -m scripts.bench_catalog [--objects 10000,100000] [--rounds 3] [--rtt-ms 50]
        [--shuffle-window 16 --shuffle-fill 4] [--against COMMIT]

Goals (issue 44, with 50 ms a request): at 100,000 objects <= 15 s to the first batch cold,
<= 3 s with the kept catalog or a manifest; at 10,000 <= 5 s cold; <= 100 bytes an object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scripts.harness import ROOT, Figure, add_json_flag, commit_tree, min_median_max, write_results

_PUT_THREADS = 32
_GET_THREADS = 16
_GET_SAMPLE = 2000


def fill(store, bucket: str, n: int, folders: int) -> float:
    """N objects in `bucket`; returns the PUTs per second."""
    client = store.client()
    client.create_bucket(Bucket=bucket)

    def put(i: int) -> None:
        body = f'{{"text": "object {i} of the catalog benchmark, a tiny document"}}\n'.encode()
        client.put_object(Bucket=bucket, Key=f"data/{i % folders:04d}/{i:08d}.jsonl", Body=body)

    started = time.perf_counter()
    with ThreadPoolExecutor(_PUT_THREADS) as pool:
        list(pool.map(put, range(n)))
    return n / (time.perf_counter() - started)


def raw_rates(store, bucket: str, n: int) -> tuple[float, float]:
    """moto's listing rate (keys/s, one sequential listing) and GET rate (objects/s, 16 threads)."""
    client = store.client()
    started = time.perf_counter()
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="data/")
        for o in page.get("Contents", [])
    ]
    listed = len(keys) / (time.perf_counter() - started)
    sample = keys[:: max(1, len(keys) // _GET_SAMPLE)][:_GET_SAMPLE]
    started = time.perf_counter()
    with ThreadPoolExecutor(_GET_THREADS) as pool:
        list(pool.map(lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(), sample))
    return listed, len(sample) / (time.perf_counter() - started)


def spec_for(endpoint: str, bucket: str, cache_dir: str, shuffle: tuple[int, int] = (0, 0)) -> dict:
    return {
        "sources": [{"name": "tiny", "path": f"s3://{bucket}/data/*/*.jsonl", "endpoint": endpoint}],
        "seq_len": 256,
        "rows": 4,
        "seed": 0,
        "epochs": 1,
        "workers": 2,
        "cache_dir": cache_dir,
        "shuffle_window": shuffle[0],
        "shuffle_fill": shuffle[1],
    }


def first_batch_s(spec: dict) -> float:
    """Seconds from launching the job to one rank's first batch."""
    import omniload

    started = time.perf_counter()
    # a cold start on this store indexes some 140 objects a second (two requests each): longer than
    # the Job's default startup timeout (600 s) at 10^5 objects
    with omniload.Job(spec, startup_timeout=3600) as job:
        loader = omniload.connect(job.addr, job.token, rank=0, world_size=1)
        next(iter(loader))
        seconds = time.perf_counter() - started
        loader.close()
    return seconds


def catalog_bytes(spec: dict) -> int:
    """Bytes of Python objects the catalog holds in this process (tracemalloc, the result held)."""
    from omniload.coordinator.pool.catalog import build_catalog
    from omniload.coordinator.pool.worker_pool import stop_helpers
    from omniload.spec import Spec

    parsed = Spec.from_dict(spec)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    catalog = build_catalog(parsed)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    stop_helpers()
    del catalog
    return held


def _launches(values: list[float]) -> str:
    """Each launch's seconds, or their range where there are more than three."""
    if len(values) > 3:
        return f"{min(values):.2f}-{max(values):.2f} s ({len(values)} launches)"
    return ", ".join(f"{v:.2f}" for v in values) + " s"


def figures_of(
    rows: list[tuple], setup: str = "", against: tuple[str, dict[int, list[float]]] | None = None
) -> list[Figure]:
    """A start figure a bucket size, and the bytes an object over all sizes; `setup` says how
    the store was reached and the fill, where not the defaults; `against`: (commit, its kept
    launches by size), alternated with this checkout's."""
    figures = [
        Figure(
            f"start on {n:,} S3 objects{setup}, cold / kept catalog",
            f"{_launches(cold)} / {_launches(cached)}"
            + (f"; {against[0]} kept: {_launches(against[1][n])}" if against else "")
            + f", moto serving {gets:,.0f} GETs/s",
            f"{against[0]}, alternating" if against else "none",
        )
        for n, cold, cached, _, _, _, gets in rows
    ]
    if rows:  # the memory where it was measured (--memory-objects), the file at every size
        sizes = "; ".join(
            f"{'?' if math.isnan(memory) else f'{memory:.0f}'} B / {file:.0f} B at {n:,} objects"
            for n, _, _, memory, file, _, _ in rows
        )
        met = all(max(0 if math.isnan(memory) else memory, file) <= 100 for _, _, _, memory, file, _, _ in rows)
        figures.append(
            Figure(
                "catalog an object, in memory / on disk (≤ 100 B)",
                f"{sizes} (tracemalloc around build_catalog; the catalog file): {'**met**' if met else '**missed**'}",
            )
        )
    return figures


def kept_load_s(objects: int, rounds: int) -> list[float]:
    """Seconds to read a kept catalog of `objects` one-shard objects back into its table, as a
    restart does (np.load of the columns, then the table), each of `rounds` times."""
    import numpy as np

    from omniload.formats.shard_table import ShardTable, table_arrays, table_from_arrays
    from tests.corpus import bucket_objects

    shards = bucket_objects(objects)
    seconds = []
    with tempfile.TemporaryDirectory(prefix="bench-catalog-load-") as folder:
        path = Path(folder, "catalog.npz")
        with open(path, "wb") as file:
            np.savez(file, **table_arrays(ShardTable(shards), "0/"))
        for _ in range(rounds):
            start = time.perf_counter()
            with np.load(path, allow_pickle=False) as arrays:
                table = table_from_arrays(arrays, "0/")
            assert table[objects - 1] == shards[-1]
            seconds.append(time.perf_counter() - start)
    return seconds


def timed_launch(spec: dict, proxy, n: int, what: str) -> float:  # noqa: ANN001  (tests.s3_store.FaultyProxy)
    """first_batch_s, printed with the requests the launch made an object (through the proxy)."""
    before = dict(proxy.requests) if proxy else {}
    seconds = first_batch_s(spec)
    made = ""
    if proxy:
        counts = {kind: count - before.get(kind, 0) for kind, count in proxy.requests.items()}
        made = " (" + ", ".join(f"{kind} {count / n:.2f}" for kind, count in sorted(counts.items())) + " an object)"
    print(f"  {what} launch: {seconds:.2f} s{made}", flush=True)
    return seconds


def report(
    args: argparse.Namespace, rows: list[tuple], loads: list[float], against: dict[int, list[float]], setup: str
) -> None:
    """The table of every size, the goals, and the figures and raw numbers for --json."""
    print(
        f"\n{'objects':>9}{'cold s min/med/max':>22}{'cached s min/med/max':>24}{'B/object':>10}"
        f"{'file B/obj':>12}{'moto LIST/s':>13}{'moto GET/s':>12}"
    )
    for n, cold, cached, per_object, file_per_object, listed, gets in rows:
        print(
            f"{n:>9,}{min_median_max(cold, '.2f'):>22}{min_median_max(cached, '.2f'):>24}{per_object:>10.0f}"
            f"{file_per_object:>12.0f}{listed:>13,.0f}{gets:>12,.0f}"
        )
    print("goals: at 100,000 objects <= 15 s cold, <= 3 s cached; at 10,000 <= 5 s cold; <= 100 B/object")
    keys = ("objects", "cold_s", "cached_s", "memory_b_an_object", "file_b_an_object", "moto_keys_listed_a_s")
    keys += ("moto_gets_a_s",)
    raw = {"folders": args.folders, "rtt_ms": args.rtt_ms}
    raw.update(shuffle_window=args.shuffle_window, shuffle_fill=args.shuffle_fill)
    unmeasured = [tuple(None if isinstance(x, float) and math.isnan(x) else x for x in row) for row in rows]
    raw.update(sizes=[dict(zip(keys, row)) for row in unmeasured], kept_load_s=loads)  # JSON has no NaN
    if against:
        raw["against"] = {"commit": args.against, "cached_s": against}
    figures = figures_of(rows, setup, (args.against, against) if args.against else None)
    if loads:
        within = "**met**" if max(loads) <= 1 else "**missed**"
        figures.append(
            Figure(
                f"kept catalog load at {args.load_objects:,} objects (≤ 1 s)",
                f"{min(loads) * 1e3:.0f}-{max(loads) * 1e3:.0f} ms (np.load of the columns, 5 loads): {within}",
            )
        )
    write_results(args.json, figures, raw)


def measure(
    args: argparse.Namespace,
    store,  # noqa: ANN001  (tests.s3_store.MotoServer)
    proxy,  # noqa: ANN001  (tests.s3_store.FaultyProxy or None)
    n: int,
    tree: Path | None,
    against: list[float],
) -> tuple:
    """One bucket size: fill it, moto's own rates, the cold and cached launches (those of
    `tree`'s code, --against, alternating with this checkout's into `against`), the memory."""
    bucket = f"catalog-{n}"
    endpoint = proxy.endpoint if proxy else store.endpoint
    shuffle = (args.shuffle_window, args.shuffle_fill)
    puts = fill(store, bucket, n, args.folders)
    listed, gets = raw_rates(store, bucket, n)
    print(
        f"N={n:,}: moto PUT {puts:,.0f}/s (32 threads), LIST {listed:,.0f} keys/s (one listing), "
        f"GET {gets:,.0f}/s (16 threads)",
        flush=True,
    )
    cold: list[float] = []
    cached: list[float] = []
    # the first cold launch writes the catalog the cached launches read: one kept folder a size
    with tempfile.TemporaryDirectory(prefix="bench-catalog-kept-") as kept:
        for round_ in range(args.cold_rounds or args.rounds):
            with tempfile.TemporaryDirectory(prefix="bench-catalog-") as fresh:
                spec = spec_for(endpoint, bucket, kept if round_ == 0 else fresh, shuffle)
                cold.append(timed_launch(spec, proxy, n, "cold"))
        catalog_file = sum(p.stat().st_size for p in Path(kept, "catalogs").glob("catalog-*.npz"))
        for round_ in range(args.rounds):
            sides = [(None, cached), (tree, against)] if tree else [(None, cached)]
            for side, into in sides if round_ % 2 == 0 else sides[::-1]:
                with _code_of(side):
                    into.append(
                        timed_launch(
                            spec_for(endpoint, bucket, kept, shuffle),
                            proxy,
                            n,
                            f"cached ({args.against})" if side else "cached",
                        )
                    )
    held = math.nan  # the tracemalloc pass lists and indexes the bucket once more: not at every size
    if n <= args.memory_objects:
        with tempfile.TemporaryDirectory(prefix="bench-catalog-") as cache:
            held = catalog_bytes(spec_for(endpoint, bucket, cache))
    print(f"  catalog in memory: {held / n:.0f} B/object; catalog file {catalog_file / n:.0f} B/object", flush=True)
    return (n, cold, cached, held / n, catalog_file / n, listed, gets)


@contextlib.contextmanager
def _code_of(tree: Path | None) -> Iterator[None]:
    """The coordinator and workers a launch starts import omniload from `tree` (None: this
    checkout): it is their working folder, which `python -m` puts first on sys.path, ahead of
    PYTHONPATH, and their PYTHONPATH, which the forkserver's workers inherit."""
    folder, before = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(tree or ROOT)
    os.environ["PYTHONPATH"] = str(tree or ROOT)
    try:
        where = subprocess.run(
            [sys.executable, "-c", "import omniload; print(omniload.__file__)"], capture_output=True, text=True
        ).stdout.strip()
        if not where.startswith(str(tree or ROOT)):  # the A/B would compare a side with itself
            raise SystemExit(f"a launch meant for {tree or ROOT} would import omniload from {where}")
        yield
    finally:
        os.chdir(folder)
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before


def main() -> None:
    from tests.s3_store import CREDENTIALS, FaultyProxy, MotoServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--objects", default="10000,100000", help="bucket sizes, comma-separated (0: only --load-objects)"
    )
    parser.add_argument("--folders", type=int, default=100, help="top folders the objects are spread over")
    parser.add_argument("--rounds", type=int, default=3, help="cold and cached launches per size")
    parser.add_argument("--cold-rounds", type=int, default=0, help="cold launches per size (0: --rounds)")
    parser.add_argument(
        "--load-objects", type=int, default=100_000, help="time loading a kept catalog of this many objects (0: not)"
    )
    parser.add_argument(
        "--memory-objects", type=int, default=20_000, help="measure the catalog's memory at sizes up to this"
    )
    parser.add_argument("--rtt-ms", type=float, default=0, help="each request held this long by a proxy (0: none)")
    parser.add_argument("--shuffle-window", type=int, default=0, help="the jobs' --shuffle-window (0: the default)")
    parser.add_argument("--shuffle-fill", type=int, default=0, help="the jobs' --shuffle-fill (0: the default)")
    parser.add_argument("--against", help="a commit whose cached launches alternate with this checkout's")
    add_json_flag(parser)
    args = parser.parse_args()
    loads = kept_load_s(args.load_objects, 5) if args.load_objects else []
    if loads:
        print(
            f"kept catalog of {args.load_objects:,} objects loaded in {min_median_max(loads, '.3f')} s "
            "(min/med/max of 5)"
        )

    os.environ.update(CREDENTIALS)
    store = MotoServer()
    proxy = FaultyProxy(store.port, delay_s=args.rtt_ms / 1000) if args.rtt_ms else None
    shuffle = (args.shuffle_window, args.shuffle_fill)
    # how the store is reached and the shuffle, where not the defaults: in the log and the figures
    setup = (f", {args.rtt_ms:g} ms a request" if args.rtt_ms else "") + "".join(
        f", --shuffle-{name} {value}" for name, value in (("window", shuffle[0]), ("fill", shuffle[1])) if value
    )
    print(
        f"machine: {os.cpu_count()} cores; store: moto {__import__('moto').__version__} on loopback{setup}; "
        f"{args.folders} folders; {args.rounds} cached launches per size, {args.cold_rounds or args.rounds} cold"
        + (f", each alternating with {args.against}'s" if args.against else "")
    )
    rows: list[tuple] = []
    against: dict[int, list[float]] = {}  # size: COMMIT's kept launches
    try:
        with commit_tree(args.against) if args.against else contextlib.nullcontext() as tree:
            for n in [int(x) for x in args.objects.split(",") if x and int(x)]:
                rows.append(measure(args, store, proxy, n, tree, against.setdefault(n, [])))
    finally:
        if proxy:
            proxy.close()
        store.stop()
    report(args, rows, loads, {n: v for n, v in against.items() if v}, setup)


if __name__ == "__main__":
    main()
