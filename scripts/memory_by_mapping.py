"""Where the memory of omniload's processes goes: PSS of the coordinator, its forkserver, its
resource tracker and each worker, by mapping (heap, anonymous, each library), while one rank
consumes a job over K sources of the bench corpus.

    python -m scripts.memory_by_mapping [--sources 16] [--workers 4] [--tokenizer bpe|bytes] [--steps 60]
        [--docs 4000] [--median-bytes 600] [--group-rows 1000] [--samples 1]

--group-rows sets the rows of the sources' parquet row groups and Arrow record batches (each
one shard): large ones show what a worker holds per row of a shard. --samples K > 1 also
prints each process's PSS over K samples 10 steps apart (median, min-max): one sample can
catch a slice being decoded.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics


def pss_by_mapping(pid: int) -> collections.Counter:
    """kB of PSS per mapping name ([heap], [anon], a library's file name) from /proc/PID/smaps."""
    by: collections.Counter = collections.Counter()
    name = "[anon]"
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if not parts[0].endswith(":"):  # a mapping's header: address range, perms, ..., path
                name = os.path.basename(parts[5]) if len(parts) > 5 else "[anon]"
            elif parts[0] == "Pss:":
                by[name] += int(parts[1])
    return by


def main() -> None:
    import omniload
    from scripts.bench_data import bpe_tokenizer, make_sources
    from scripts.bench_memory import pids_by_role, pss

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tokenizer", default="bpe", help="bpe (the 32k BPE of bench_data), bytes, or a path")
    parser.add_argument("--steps", type=int, default=60, help="steps the rank consumes before measuring")
    parser.add_argument("--docs", type=int, default=4000, help="documents a source")
    parser.add_argument("--median-bytes", type=int, default=600, help="a document's median length")
    parser.add_argument("--group-rows", type=int, default=1000, help="rows of a row group or record batch")
    parser.add_argument("--samples", type=int, default=1, help="samples of PSS, 10 steps apart")
    args = parser.parse_args()
    tokenizer = bpe_tokenizer() if args.tokenizer == "bpe" else args.tokenizer
    spec = {
        "sources": make_sources(args.sources, args.docs, args.median_bytes, group_rows=args.group_rows),
        "seq_len": 2048,
        "rows": 2,
        "workers": args.workers,
        "epochs": 0,
        "tokenizer": tokenizer,
    }
    with omniload.Job(spec) as job:
        loader = omniload.connect(job.addr, job.token, rank=0, world_size=1)
        batches = iter(loader)
        for _ in range(args.steps):
            next(batches)
        sampled: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
        for sample in range(args.samples if args.samples > 1 else 0):
            for _ in range(10 if sample else 0):
                next(batches)
            for role, pids in pids_by_role(job._process.pid).items():
                for pid in pids:  # a worker the pool let go meanwhile counts 0 in that sample
                    sampled[role, pid].append(pss([pid]))
        print(f"{args.sources} sources, {args.workers} workers, tokenizer {args.tokenizer}; PSS MB, largest mappings")
        for role, pids in pids_by_role(job._process.pid).items():
            for pid in pids:
                by = pss_by_mapping(pid)
                top = ", ".join(f"{name[:32]} {kb / 1024:.1f}" for name, kb in by.most_common(5))
                print(f"{role:<12}{pid:>8}{sum(by.values()) / 1024:>7.0f}  {top}")
        if sampled:
            print(f"over {args.samples} samples 10 steps apart: PSS MB, median (min-max)")
            for (role, pid), values in sampled.items():
                print(f"{role:<12}{pid:>8}{statistics.median(values):>7.1f}  ({min(values):.1f}-{max(values):.1f})")
        loader.close()


if __name__ == "__main__":
    main()
