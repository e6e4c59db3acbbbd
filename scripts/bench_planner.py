"""The planner alone: CPU time a step of the real Stepper over documents held in memory.

The coordinator's delivery is bound by its planning thread (bench_fanout.py's coordinator CPU
sits near 100% once the pool keeps up), and planning costs per document: reading its record,
cutting it into units, the shuffle (its keys, the document's tokens written to the spill on
local disk and each unit's read back, as the coordinator keeps them), the mixture's draw,
balancing and building the ranks' arrays. The shuffle's horizon is a few global batches
(--horizon-batches), so that the timed steps read a document for each unit they draw, as every
horizon does once its fill is read: the default horizon would read all of this corpus in the
first step and time only draws. This times that path without rings, workers or sockets, in CPU time (which
holds better than wall time on a shared machine): 3 sources of documents with lognormal
lengths (median 600 tokens, as bench_data's text with the byte tokenizer), each step dp ranks
of rows x seq_len. Prints ms a step, ns a token slot and a digest of every batch array, so two
commits can be compared for speed and for identical batches.

    python -m scripts.bench_planner [--dp 256] [--steps 30] [--rounds 3] [--intake memory|rings]

--intake rings takes the documents through the coordinator's real intake (SourceIntake over a
shared-memory ring a source, every record written before the step is timed), so reading and
decoding records counts too; --intake memory (the default) hands them over from a list. Both
give the same batches (the digest).

What it does not show: the workers writing the records, sending, or the event loop.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import numpy as np

from omniload.coordinator.plan.stepper import Stepper
from omniload.coordinator.pool.catalog import SourceCatalog
from omniload.coordinator.pool.intake import SourceIntake
from omniload.coordinator.spill import Spill
from omniload.formats.records import decode, doc_record, tokens_of
from omniload.formats.ring import Ring
from omniload.formats.shard_table import ShardTable
from omniload.formats.shards import Shard
from omniload.spec import Spec
from scripts.harness import Figure, add_json_flag, write_results
from tests.intakes import MemoryIntake

SEQ_LEN, ROWS, SOURCES, MEDIAN_TOKENS = 2048, 4, 3, 600


def _as_records_give_it(tokens: np.ndarray) -> np.ndarray:
    """The ids as the intake hands them to the planner: through a ring record (dtype included)."""
    return tokens_of(decode(b"".join(bytes(part) for part in doc_record(0, 0, 0, tokens))))


def _ring_intake(source: int, docs: list[np.ndarray], rings: list[Ring]) -> SourceIntake:
    """The coordinator's intake over one ring holding every document's record, in order: one
    shard of len(docs) rows, one pass."""
    capacity = sum(d.nbytes + 64 for d in docs)
    ring = Ring.create(Path(f"/dev/shm/omniload-bench-planner-{os.getpid()}-{source}"), capacity)
    rings.append(ring)
    for pos, tokens in enumerate(docs):
        assert ring.try_write(*doc_record(0, pos, pos, tokens)), "the ring must hold every record"
    shard = Shard("unused", "parquet", 0, 1, len(docs), 0)
    catalog = SourceCatalog(source, f"s{source}", "text", "bytes", ShardTable([shard]), len(docs), 1)
    return SourceIntake(catalog, [ring], 0, 1)


HORIZON_BATCHES = 4


def stepper(dp: int, steps: int, rings: list[Ring] | None = None, spill: Spill | None = None) -> Stepper:
    """A Stepper over enough documents for `steps` steps after the first (which fills the
    windows); with `rings` (a list the caller closes and unlinks), through real rings."""
    rng = np.random.default_rng(0)
    per_source = dp * ROWS * SEQ_LEN * (steps + HORIZON_BATCHES + 1) * 1.5 / SOURCES
    intakes: list = []
    for source in range(SOURCES):
        docs, total = [], 0
        while total < per_source:
            length = max(1, int(rng.lognormal(np.log(MEDIAN_TOKENS), 0.8)))
            docs.append(_as_records_give_it(rng.integers(0, 256, length).astype(np.int32)))
            total += length
        if rings is None:
            intakes.append(MemoryIntake(source, len(docs), docs.__getitem__))
        else:
            intakes.append(_ring_intake(source, docs, rings))
    spec = Spec.from_dict(
        {
            "sources": [{"name": f"s{i}", "path": "unused", "weight": 1.0} for i in range(SOURCES)],
            "seq_len": SEQ_LEN,
            "rows": ROWS,
            "shuffle_window": HORIZON_BATCHES * dp * ROWS,
        }
    )
    planner = Stepper(spec, intakes, store=spill)  # type: ignore[arg-type]  (the intake's interface, in memory)
    planner.dp = dp
    return planner


def run(dp: int, steps: int, intake: str = "memory") -> tuple[float, str]:
    """(CPU seconds a step, digest of every array of every step)."""
    rings: list[Ring] | None = [] if intake == "rings" else None
    spill = Spill()
    try:
        return _timed(stepper(dp, steps, rings, spill), steps)
    finally:
        spill.close()
        for ring in rings or []:
            ring.close()
            ring.unlink()


def _timed(planner: Stepper, steps: int) -> tuple[float, str]:
    for _ in range(HORIZON_BATCHES + 1):  # reads the fill: a start-up cost, not the steady state
        planner.next_step()
    digest, cpu = hashlib.blake2b(digest_size=8), 0.0
    for _ in range(steps):
        start = time.process_time()
        step = planner.next_step()
        cpu += time.process_time() - start
        assert step is not None, "the documents ran out: raise per_source"
        for batch in step.batches:
            for name in sorted(batch):
                digest.update(name.encode())
                digest.update(batch[name].tobytes())
    return cpu / steps, digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--intake", choices=("memory", "rings"), default="memory")
    add_json_flag(parser)
    args = parser.parse_args()
    slots = args.dp * ROWS * SEQ_LEN
    print(
        f"dp {args.dp}, {ROWS} x {SEQ_LEN} a rank, {SOURCES} sources, median {MEDIAN_TOKENS} tokens a document, "
        f"intake {args.intake}"
    )
    rounds = []
    for _ in range(args.rounds):
        per_step, digest = run(args.dp, args.steps, args.intake)
        rounds.append({"ms_a_step": per_step * 1e3, "ns_a_slot": per_step / slots * 1e9, "digest": digest})
        print(f"{per_step * 1e3:.1f} ms CPU a step, {per_step / slots * 1e9:.1f} ns a token slot, batches {digest}")
    ns = sorted(r["ns_a_slot"] for r in rounds)
    figure = Figure(
        f"planner CPU a token slot, dp {args.dp} (issue 41: ≤ 10 ns)",
        f"{ns[0]:.0f}-{ns[-1]:.0f} ns over {len(ns)} rounds, batches {rounds[-1]['digest']}",
    )
    write_results(args.json, [figure], {"dp": args.dp, "steps": args.steps, "intake": args.intake, "rounds": rounds})


if __name__ == "__main__":
    main()
