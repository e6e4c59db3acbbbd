"""Ring soak: millions of checked records through one shared-memory ring, writers killed at random.

A writer process writes record i (its size and bytes a function of i: mostly documents' sizes,
now and then up to half the ring, so records wrap at every offset) as fast as the ring takes
them; this process reads and compares every byte with what record i must be. Every
--kill-every seconds (on average) the writer is SIGKILLed wherever it is (mid-record, often),
the ring is reset as the coordinator does for a dead worker, and a new writer goes on from the
record after the last one read. A thread of this process reads the ring's header all along,
as `status` does.

Counted: records read, misreads (a record whose bytes are not record i's: the ring handed out
wrong data), corruptions (RingCorrupt: a record failed its checks; none is expected, and any
is reported with its message), kills. Exit code 1 on any misread or corruption. Writes JSON
with --json.

    python -m scripts.ring_soak [--seconds 600] [--records 10000000] [--ring-kb 1024] [--kill-every 2]

Run it beside another benchmark (scripts/bench_remote.py, where a desynchronised ring was once
seen) to soak the ring under a loaded machine.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

from omniload.formats.ring import FRAME, Ring, RingCorrupt, segment_path
from scripts.harness import Figure, add_json_flag, write_results


def record(i: int, limit: int) -> bytes:
    """Record i: its size drawn from i (mostly 0 to 4 KB, as documents are; one in 256 up to
    `limit`, half the ring) and bytes that say which record it is."""
    drawn = (i * 0x9E3779B97F4A7C15 >> 32) & 0xFFFFFFFF
    size = drawn % (limit + 1) if drawn % 256 == 0 else drawn % 4097
    block = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()
    return (block * (size // 32 + 1))[:size]


def _write(path: str, first: int, limit: int) -> None:
    ring = Ring.attach(Path(path))
    i = first
    while True:
        data = record(i, limit)
        while not ring.try_write(data):
            pass  # spin: a kill lands anywhere in a write
        i += 1


def _watch_header(ring: Ring, stop: threading.Event) -> None:
    while not stop.is_set():
        ring.used(), ring.work(), ring.store()


def soak(seconds: float, records: int, ring_kb: int, kill_every: float, seed: int) -> dict:
    path = segment_path(os.getpid(), "soak", f"ring{time.monotonic_ns()}")
    ring = Ring.create(path, ring_kb << 10)
    limit = ring.capacity // 2 - FRAME
    context = multiprocessing.get_context("fork")
    rng = random.Random(seed)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_header, args=(ring, stop), daemon=True)
    watcher.start()
    figures = {"records": 0, "misreads": 0, "corruptions": 0, "kills": 0, "bytes": 0, "errors": []}
    started = time.monotonic()
    try:
        while figures["records"] < records and time.monotonic() - started < seconds:
            writer = context.Process(target=_write, args=(str(path), figures["records"], limit), daemon=True)
            writer.start()
            until = time.monotonic() + rng.expovariate(1 / kill_every)
            while time.monotonic() < until and figures["records"] < records:
                _read_one(ring, figures, limit)
            os.kill(writer.pid, signal.SIGKILL)
            writer.join()
            figures["kills"] += 1
            while _read_one(ring, figures, limit):  # what it published before it died: whole
                pass
            ring.reset()
    finally:
        stop.set()
        watcher.join()
        ring.close()
        ring.unlink()
    figures["seconds"] = round(time.monotonic() - started, 1)
    figures["records_per_s"] = round(figures["records"] / figures["seconds"])
    return figures


def _read_one(ring: Ring, figures: dict, limit: int) -> bool:
    try:
        data = ring.read()
    except RingCorrupt as exc:
        figures["corruptions"] += 1
        figures["errors"].append(str(exc))
        ring.reset()
        return False
    if data is None:
        return False
    if data != record(figures["records"], limit):
        figures["misreads"] += 1
        figures["errors"].append(f"record {figures['records']}: {len(data)} bytes not its own")
    figures["records"] += 1
    figures["bytes"] += len(data)
    return True


def soak_figure(args: argparse.Namespace, counts: dict) -> Figure:
    """The summary's soak row: its target where the run is the documented 10-minute soak."""
    found = (
        f"{counts['records']:,} records in {counts['seconds']:g} s, {counts['kills']:,} kills, "
        f"{counts['misreads']} misreads, {counts['corruptions']} failing their checks"
    )
    if (args.seconds, args.records, args.ring_kb, args.kill_every) == (600, 10_000_000, 1024, 2.0):
        met = counts["records"] >= 10_000_000 and not counts["misreads"]
        return Figure(
            "ring records checked, a soak with writers SIGKILLed (≥ 10^7 records in 10 min, 0 misreads)",
            f"{found}: {'**met**' if met else '**missed**'}",
        )
    return Figure(
        f"ring records checked, a {args.seconds:g} s soak of a {args.ring_kb:,} KB ring, a writer SIGKILLed every "
        f"{args.kill_every:g} s on average",
        found,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--ring-kb", type=int, default=1024)
    parser.add_argument("--kill-every", type=float, default=2.0, help="mean seconds between writer kills")
    parser.add_argument("--seed", type=int, default=0)
    add_json_flag(parser)
    args = parser.parse_args()
    figures = soak(args.seconds, args.records, args.ring_kb, args.kill_every, args.seed)
    figures["errors"] = figures["errors"][:20]
    print(
        f"ring soak: {figures['records']:,} records ({figures['bytes'] / 1e9:.2f} GB) in {figures['seconds']}s "
        f"({figures['records_per_s']:,}/s), {figures['kills']} writers killed: {figures['misreads']} misreads, "
        f"{figures['corruptions']} records failing their checks"
    )
    for error in figures["errors"]:
        print("  ", error)
    write_results(
        args.json, [soak_figure(args, figures)], {"ring_kb": args.ring_kb, "kill_every": args.kill_every} | figures
    )
    sys.exit(1 if figures["misreads"] or figures["corruptions"] else 0)


if __name__ == "__main__":
    main()
