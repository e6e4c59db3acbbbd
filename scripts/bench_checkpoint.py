"""The checkpoint folder's cost: bytes per step, folder size, and resume (replay) time.

The planner runs over in-memory sources (lognormal document lengths, median 600 tokens, 2% of
documents 20-60 x seq_len), so these figures are the coordinator's own: no workers, no files.
Each step every rank consumed is handed to a CheckpointWriter (--snapshot-every 100,
--keep-snapshots 2) and flushed before the next, as when the disk keeps up (the most records:
a slower disk coalesces steps into fewer). Resume time is what `--resume DIR` adds before the
first batch: restore the snapshot, re-read its windows and carry, and replay the planner for
the steps since the snapshot.

    python -m scripts.bench_checkpoint [--steps 10000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from omniload.coordinator.checkpoint.folder import CheckpointWriter, last_position
from omniload.coordinator.plan.documents import Doc
from omniload.coordinator.plan.stepper import Stepper
from omniload.spec import Spec
from scripts.harness import Figure, add_json_flag, write_results

_TOKENS = np.zeros(1 << 22, dtype=np.int32)  # every document's tokens are a view of this


class _Source:
    """An endless in-memory source with the intake's interface; documents cost no memory."""

    def __init__(self, index: int, seq_len: int) -> None:
        self.catalog = SimpleNamespace(index=index, name=f"s{index}", images=None)
        self._seq_len = seq_len
        self.group, self.pos, self.dry = 0, 0, False

    @property
    def cursor(self) -> tuple[int, int]:
        return self.group, self.pos

    def epoch_end(self, group: int) -> int:
        return 1 << 40

    def seek(self, group: int, pos: int) -> None:
        self.group, self.pos = group, pos

    def poll(self, until_group: int | None = None) -> Doc:
        rng = np.random.default_rng([self.catalog.index, self.pos])
        long = rng.random() < 0.02
        length = int(rng.integers(20, 60) * self._seq_len) if long else max(1, int(rng.lognormal(np.log(600), 1.0)))
        self.pos += 1
        return Doc(
            self.catalog.index,
            self.pos - 1,
            _TOKENS[: min(length, len(_TOKENS))],
            self.group,
            self.pos - 1,
            after=self.cursor,
        )


def _spec(seq_len: int, rows: int, fill: int) -> Spec:
    """`fill`: --shuffle-fill (0: the job's default); a small one makes each Stepper's first fill cheap."""
    return Spec.from_dict(
        {
            "sources": [{"name": f"s{i}", "path": "x", "weight": w} for i, w in enumerate((5, 3, 2))],
            "seq_len": seq_len,
            "rows": rows,
            "balance": "attention",
            "epochs": 0,
            "shuffle_fill": fill,
        }
    )


def _stepper(spec: Spec, dp: int) -> Stepper:
    stepper = Stepper(spec, [_Source(i, spec.seq_len) for i in range(3)])
    stepper.dp = dp
    return stepper


def folder_size(steps: int, dp: int, seq_len: int, rows: int, fill: int) -> dict:
    spec = _spec(seq_len, rows, fill)
    stepper = _stepper(spec, dp)
    with tempfile.TemporaryDirectory() as folder:
        errors: list = []
        writer = CheckpointWriter(folder, 100, 2, {"spec": spec.to_dict(), "files": {}}, errors.append)

        started = time.perf_counter()
        for _ in range(steps):
            stepper.next_step(build=False)
            writer.write(stepper.state_dict("f"), dp)
            writer.flush()
        writer.close()
        assert not errors, errors
        files = list(Path(folder).iterdir())
        logs = [p for p in files if p.name.startswith("deltas-")]
        snapshots = [p for p in files if p.name.startswith("snapshot-")]
        records = sum(p.read_bytes().count(b"\n") for p in logs)
        log_bytes = sum(p.stat().st_size for p in logs)
        result = {
            "dp": dp,
            "seq_len": seq_len,
            "rows": rows,
            "steps": steps,
            "seconds": time.perf_counter() - started,
            "folder_bytes": sum(p.stat().st_size for p in files),
            "snapshots": len(snapshots),
            "logs": len(logs),
            "record_bytes": log_bytes / max(1, records),
            "snapshot_bytes": max(p.stat().st_size for p in snapshots),
        }
        print(
            f"DP={dp}, seq_len {seq_len} x rows {rows}, {steps:,} steps ({time.perf_counter() - started:.0f}s): "
            f"folder {sum(p.stat().st_size for p in files) / 1024:,.1f} KB in {len(snapshots)} snapshots and "
            f"{len(logs)} logs; a step's record {log_bytes / max(1, records):.0f} B; a snapshot "
            f"{max(p.stat().st_size for p in snapshots) / 1024:.1f} KB"
        )
    return result


def resume_time(dp: int, seq_len: int, rows: int, snapshot_at: int, replays: list[int], fill: int) -> list[dict]:
    spec = _spec(seq_len, rows, fill)
    print(f"DP={dp}, seq_len {seq_len} x rows {rows}: resume time by steps since the snapshot")
    out = []
    for replay in replays:
        stepper = _stepper(spec, dp)
        with tempfile.TemporaryDirectory() as folder:
            writer = CheckpointWriter(folder, snapshot_at, 2, {"spec": spec.to_dict(), "files": {}}, print)

            for _ in range(snapshot_at + replay):
                stepper.next_step(build=False)
                writer.write(stepper.state_dict("f"), dp)
            writer.close()
            expected = stepper.state_dict("f")
            started = time.perf_counter()
            found = last_position(folder)
            resumed = _stepper(spec, found.dp)
            resumed.load_state_dict({**found.state, "live": found.state["live"] + found.live})

            resumed.rehydrate()
            for _ in range(found.replay):
                resumed.next_step(build=False)
            took = time.perf_counter() - started
            assert resumed.state_dict("f") == expected, "the replay must land on the same position"
            out.append({"dp": dp, "seq_len": seq_len, "rows": rows, "replayed": found.replay, "seconds": took})
            print(
                f"  {found.replay:4d} steps replayed: {took:6.2f}s ({took / max(1, found.replay) * 1000:.0f} ms/step)"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--replays", default="0,25,50,99")
    parser.add_argument("--large-dp", type=int, default=1024)
    parser.add_argument(
        "--shuffle-fill", type=int, default=0, help="the jobs' --shuffle-fill (0: the default; small: a quick check)"
    )
    add_json_flag(parser)
    args = parser.parse_args()
    replays = [int(r) for r in args.replays.split(",")]
    folders = [
        folder_size(args.steps, 2, 2048, 4, args.shuffle_fill),
        folder_size(max(1, args.steps // 50), args.large_dp, 2048, 1, args.shuffle_fill),
    ]
    small = resume_time(2, 2048, 4, 100, replays, args.shuffle_fill)
    large = resume_time(args.large_dp, 2048, 1, 100, replays, args.shuffle_fill)
    small_log, large_log = (f["record_bytes"] for f in folders)
    fewest, most = replays.index(min(replays)), replays.index(max(replays))  # the same replays on both sides
    least, at_least = small[fewest]["replayed"], [small[fewest]["seconds"], large[fewest]["seconds"]]
    most, at_most = small[most]["replayed"], [small[most]["seconds"], large[most]["seconds"]]
    figures = [
        Figure("checkpoint log a step", f"{small_log:.0f} B at dp 2, {large_log:.0f} B at dp {args.large_dp:,}"),
        Figure(
            f"resume from the checkpoint folder, {most} steps since the snapshot, dp 2 / dp {args.large_dp:,}",
            f"{at_most[0]:.2f} s / {at_most[1]:.2f} s ({least} steps: {at_least[0]:.2f} s / {at_least[1]:.2f} s)",
        ),
    ]
    write_results(args.json, figures, {"folders": folders, "resumes": small + large})


if __name__ == "__main__":
    main()
