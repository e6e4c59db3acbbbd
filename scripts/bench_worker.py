"""A worker's own overhead: its tokens per CPU-second against the tokenizer alone, in one process.

bench_throughput.py sets the workers of a running job against the tokenizer timed alone on a
quiet core, so its share also holds what the machine's other processes (the coordinator,
the ranks) cost the workers' CPU-seconds. This takes the machine out: in this one process,
alternating rounds, it times

- `worker`: the records of one epoch of each bench source, made by `workers.worker._produce`
  (reading the files, slicing, the rows' order, transforming, making records), one lane a
  source, transform batches sized as for a worker holding all of them (`transform_rows`: a
  group's batches start at 32 rows and double up to that). Left out: the worker's loop around
  it (a few clock reads and flag checks every 64 records, sleeps when its rings are full) and
  the ring's copy of each record;
- `tokenizer`: the same documents' texts, read beforehand, through the same transform in
  batches of the same size;
- `tokenizer, 2,000 a call`: the same, 2,000 texts a call (bench_data.us_per_token's way),

and prints tokens per CPU-second of each and the worker's share of each tokenizer figure:
what the worker costs on top of tokenizing (goal: >= 90%, i.e. overhead <= 10%).

It also times the ring's checks on the same records (omniload/formats/ring.py), alone, in CPU
ns a token: the writer's digest of each record's parts, the worker's only new work (goal: at
most 3% of the worker's CPU a token), and the reader's check, which the coordinator pays.

    python -m scripts.bench_worker [--sources 4] [--docs 4000] [--tokenizer bpe|bytes] [--rounds 5]

What it does not show: the ring's copy, the worker's idle waits on full rings, or the machine's
other load (bench_throughput.py has those).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

# one core, as the workers run it: set before the tokenizers library starts its thread pool
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from omniload.coordinator.pool.catalog import build_catalog  # noqa: E402
from omniload.coordinator.pool.worker_pool import lane_config, stop_helpers  # noqa: E402
from omniload.formats import ring  # noqa: E402
from omniload.formats.lane_config import LaneConfig  # noqa: E402
from omniload.spec import Spec  # noqa: E402
from omniload.workers import worker  # noqa: E402
from omniload.workers.readers import iter_slices  # noqa: E402
from omniload.workers.transforms import load_transform  # noqa: E402
from scripts.harness import Figure, add_json_flag, low_high, write_results  # noqa: E402


def lanes_of(sources: list[dict], tokenizer: str) -> list[LaneConfig]:
    """One lane a source for one epoch, as a job of these sources (the spec's defaults, the
    job's own indexing) gives its workers."""
    spec = Spec.from_dict({"sources": sources, "tokenizer": tokenizer, "epochs": 1})
    try:
        catalog = build_catalog(spec)
    finally:
        stop_helpers()
    return [lane_config(spec, src, 0, 1, "", (0, 0)) for src in catalog]


def texts_of(lane: LaneConfig) -> list[str]:
    """Every document's text of the lane's shards (their order does not matter to a tokenizer)."""
    return [value for shard in lane.shards for values in iter_slices(shard, "text") for value in values]


def cpu_timed(run: Callable[[], int]) -> float:
    """Tokens per CPU-second of `run`, which returns the tokens it made."""
    started = time.process_time()
    tokens = run()
    return tokens / (time.process_time() - started)


def main() -> None:
    from scripts.bench_data import bpe_tokenizer, make_sources

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--docs", type=int, default=4000, help="documents per source")
    parser.add_argument("--tokenizer", default="bpe", help="bpe (the 32k BPE), bytes, or a tokenizer.json")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the three")
    add_json_flag(parser)
    args = parser.parse_args()
    worker.set_up_allocators()  # as a worker does
    tokenizer = bpe_tokenizer() if args.tokenizer == "bpe" else args.tokenizer
    lanes = lanes_of(make_sources(args.sources, args.docs), tokenizer)
    transform = load_transform(tokenizer)
    batch = worker.transform_rows(lanes[0], len(lanes))
    texts = [text for lane in lanes for text in texts_of(lane)]

    def produce() -> int:
        return sum(worker._tokens_in(record) for lane in lanes for record in worker._produce(lane, held=len(lanes)))

    def tokenize(per_call: int) -> Callable[[], int]:
        return lambda: sum(
            len(ids) for i in range(0, len(texts), per_call) for ids in transform(texts[i : i + per_call])
        )

    sides = {
        "worker": produce,
        f"tokenizer, {batch} a call": tokenize(batch),
        "tokenizer, 2,000 a call": tokenize(2000),
    }
    # warm (the tokenizer loaded, the files in the page cache), and both sides make every token
    made = {name: run() for name, run in sides.items()}
    assert len(set(made.values())) == 1, f"the sides made different tokens: {made}"
    print(
        f"{args.sources} sources x {args.docs} documents ({made['worker']:,} tokens), tokenizer {args.tokenizer}, "
        f"one lane a source, the worker's transform batches up to {batch} rows; tokens per CPU-second, "
        f"{args.rounds} alternating rounds"
    )
    speeds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, run in sides.items():
            speeds[name].append(cpu_timed(run))
    for name, values in speeds.items():
        print(f"{name:<26}{statistics.median(values):>12,.0f}  (range {min(values):,.0f}-{max(values):,.0f})")
    mine = speeds["worker"]
    shares_of = {}
    for name in list(sides)[1:]:
        shares = shares_of[name] = [w / t for w, t in zip(mine, speeds[name])]
        print(
            f"worker / {name}: median {statistics.median(shares):.0%} (rounds {', '.join(f'{s:.0%}' for s in shares)})"
        )
    writes, reads = _check_costs(lanes, made["worker"], args.rounds)
    write_ns, read_ns = statistics.median(writes), statistics.median(reads)
    worker_ns = 1e9 / statistics.median(mine)
    print(
        f"the ring's checks: the writer's digest {write_ns:.2f} ns a token ({write_ns / worker_ns:.2%} of the "
        f"worker's {worker_ns:.0f} ns; goal <= 3%), the reader's check {read_ns:.2f} ns a token (the coordinator's)"
    )
    rounds = f"{args.rounds} round{'s' if args.rounds > 1 else ''}"
    # the summary's rows are the 32k BPE's: another tokenizer's figures are rows of their own
    of = "" if args.tokenizer == "bpe" else f", tokenizer {Path(args.tokenizer).name}"
    figures = [
        Figure(
            f"worker tokens per CPU-second / the tokenizer alone, in one process{of} (≥ 90%)",
            "; ".join(
                f"{statistics.median(shares):.0%} (rounds {low_high(shares, '.0%')}) against {name}"
                for name, shares in shares_of.items()
            ),
            "the tokenizer alone",
        ),
        Figure(
            f"the checks' CPU{of} (≤ 3% of the worker's)",
            f"{write_ns / worker_ns:.2%} ({write_ns:.2f} of {worker_ns:,.0f} ns a token, medians of {rounds}; "
            f"digest {low_high(writes, '.2f')} ns)",
            "the worker without checks",
        ),
    ]
    write_results(
        args.json,
        figures,
        {
            "sources": args.sources,
            "docs": args.docs,
            "tokenizer": args.tokenizer,
            "tokens": made["worker"],
            "transform_rows": batch,
            "tokens_per_cpu_s": speeds,
            "worker_shares": shares_of,
            "digest_ns_a_token": writes,
            "check_ns_a_token": reads,
        },
    )


def _check_costs(lanes: list[LaneConfig], tokens: int, rounds: int) -> tuple[list[float], list[float]]:
    """CPU ns a token of the ring's writer digest (over each record's parts, as try_write
    hashes them) and of the reader's check (one piece, as read() hashes it), a figure a round."""
    records = [
        tuple(memoryview(p).cast("B") for p in record)
        for lane in lanes
        for record in worker._produce(lane, held=len(lanes))
    ]
    joined = [b"".join(parts) for parts in records]
    sizes = [sum(len(p) for p in parts) for parts in records]
    writes, reads = [], []
    for _ in range(rounds):
        started = time.process_time()
        for number, (parts, size) in enumerate(zip(records, sizes)):
            ring._digest(number, size, parts)
        writes.append((time.process_time() - started) / tokens * 1e9)
        started = time.process_time()
        for number, (data, size) in enumerate(zip(joined, sizes)):
            ring.xxhash.xxh3_64_intdigest(data, seed=ring._seed(number, size))
        reads.append((time.process_time() - started) / tokens * 1e9)
    return writes, reads


if __name__ == "__main__":
    main()
