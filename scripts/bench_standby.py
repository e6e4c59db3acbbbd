"""Takeover time of a hot standby: kill -9 the primary, time until the ranks get batches again.

A job with one standby (`omniload.Job(spec, standby=1)`, as `omniload launch --standby 1`)
serves N ranks; the ranks run as threads of a few processes (a rank is an `omniload.connect()`
loader: real TCP, real failover), each taking `--step-s` per step. Once the checkpoint folder
says every rank has consumed `--kill-at` steps, the primary gets SIGKILL. For each rank:

    gap        its last batch from the old primary -> its first batch from the new one
    from kill  the SIGKILL -> its first batch from the new primary

(median and max over ranks), and the check that every rank got every step exactly once.
The takeover itself (lease, fork workers, replay since the snapshot, listen) is logged by the
standby ("N steps replayed in T s").

    python -m scripts.bench_standby [--ranks 2,16,64] [--steps 400] [--kill-at 120]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts.harness import Figure, add_json_flag, children_import_scripts, write_results

_PROCESSES = 4  # rank processes at most (the ranks are threads in them: 64 torch imports would not fit)


def rank_worker(ranks: list[int], world: int, step_s: float, out: str) -> None:
    """Consume the job as ranks `ranks` of `world`, one thread each; write what each saw."""
    import omniload

    seen: dict[int, list] = {}

    def consume(rank: int) -> None:
        loader = omniload.connect(rank=rank, world_size=world, prefetch=2)
        record = seen.setdefault(rank, [])
        for _ in loader:
            record.append((time.time(), loader.step, loader.info.get("epoch")))
            time.sleep(step_s)
        loader.close()

    threads = [threading.Thread(target=consume, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    Path(out).write_text(json.dumps(seen))


def measure(world: int, steps: int, kill_at: int, step_s: float, root: Path) -> dict:
    import psutil

    import omniload
    from omniload.coordinator.checkpoint.folder import last_position
    from omniload.coordinator.ha.lease import read_lease
    from scripts.bench_data import make_sources

    folder = root / f"ckpt{world}"
    spec = {
        "sources": make_sources(2, 3000),
        "seq_len": 256,
        "rows": 1,
        "epochs": 0,
        "steps": steps,
        "workers": 2,
        "checkpoint_dir": str(folder),
        "snapshot_every": 50,
    }
    with omniload.Job(spec, standby=1) as job:
        groups = [list(range(world))[i::_PROCESSES] for i in range(min(world, _PROCESSES))]
        outs = [root / f"ranks{world}-{i}.json" for i in range(len(groups))]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", ",".join(map(str, g)), str(world), str(step_s), str(out)],
                env={**os.environ, **job.env()},
            )
            for g, out in zip(groups, outs)
        ]
        while (found := last_position(folder) if folder.exists() else None) is None or found.step < kill_at:
            time.sleep(0.01)
        held = read_lease(folder)
        killed = time.time()
        psutil.Process(held.pid).send_signal(signal.SIGKILL)
        while any(p.poll() is None for p in procs):
            job.poll()  # what `omniload launch` does: a new standby where the primary was
            time.sleep(0.2)
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank process failed at {world} ranks")
        log = "\n".join(job.log_tail())
    seen = {int(r): v for out in outs for r, v in json.loads(out.read_text()).items()}
    gaps, from_kill = [], []
    for rank, record in seen.items():
        assert [step for _, step, _ in record] == list(range(steps)), f"rank {rank} missed or repeated a step"
        old = [t for t, _, epoch in record if epoch == held.epoch]
        new = [t for t, _, epoch in record if epoch == held.epoch + 1]
        gaps.append(min(new) - max(old))
        from_kill.append(min(new) - killed)
    lines = log.splitlines()  # a hot standby "caught up N steps"; a cold one "N steps replayed"
    replay = next((line for line in lines if "caught up" in line), None) or next(
        (line for line in lines if "replayed in" in line), ""
    )
    return {"world": world, "gap": gaps, "from_kill": from_kill, "replay": replay[replay.find(":") + 2 :]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,16,64")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kill-at", type=int, default=120)
    parser.add_argument("--step-s", type=float, default=0.02, help="seconds each rank spends on a step")
    add_json_flag(parser)
    args = parser.parse_args()
    children_import_scripts()  # the rank processes run this file, which imports scripts.harness
    print(
        f"omniload hot standby: kill -9 of the primary after {args.kill_at} consumed steps "
        f"(--snapshot-every 50), {args.step_s * 1000:.0f} ms per step on each rank, {os.cpu_count()} cores"
    )
    print(
        f"{'ranks':>6} {'gap median':>11} {'gap max':>8} {'from kill median':>17} {'from kill max':>14}"
        "  takeover replay"
    )
    worlds = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in map(int, args.ranks.split(",")):
            r = measure(world, args.steps, args.kill_at, args.step_s, Path(tmp))
            worlds.append(r)
            print(
                f"{world:>6} {statistics.median(r['gap']):>10.2f}s {max(r['gap']):>7.2f}s "
                f"{statistics.median(r['from_kill']):>16.2f}s {max(r['from_kill']):>13.2f}s  {r['replay']}",
                flush=True,
            )
    print("every rank got every step exactly once, identical to the plan (checked per rank)")
    largest = max(worlds, key=lambda r: r["world"])  # the summary's figure: the most ranks measured
    worst = max(largest["gap"])
    figure = Figure(
        f"hot-standby takeover, worst rank's gap at {largest['world']} ranks (< 3 s)",
        f"{worst:.2f} s (median rank {statistics.median(largest['gap']):.2f} s, from the kill "
        f"{max(largest['from_kill']):.2f} s): {'**met**' if worst < 3 else '**missed**'}",
    )
    raw = {"steps": args.steps, "kill_at": args.kill_at, "step_s": args.step_s, "worlds": worlds}
    write_results(args.json, [figure], raw)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank_worker([int(r) for r in sys.argv[2].split(",")], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
    else:
        main()
