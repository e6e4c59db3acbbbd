"""The planner's instructions a step, counted by callgrind: a measure the machine's drift does not move.

bench_planner times the Stepper in CPU seconds, and those move with this shared machine's load
(up to 2x within minutes), so a change of a few percent cannot be read from them. This runs the
same Stepper over bench_planner's documents under valgrind's callgrind and counts only the
instructions of the timed steps: callgrind writes out its counts each time the run enters
CPython's time_process_time (time.process_time), which it calls right before and right after
those steps. With --against COMMIT it counts that commit's tree too (a temporary git worktree),
then this checkout, and prints the ratio; that commit needs bench_planner's `stepper(dp,
steps, rings, spill)` and `HORIZON_BATCHES`. The same code gives the same count to the
instruction (PYTHONHASHSEED is fixed), so one run a side is enough. A Python without its
symbols (stripped) gives callgrind no time_process_time to stop at: the run then says so.

    python -m scripts.planner_instructions [--against COMMIT] [--dp 16] [--steps 10] [--intake memory|rings]

What it does not show: time. The kernel's work (pread, pwrite, page faults) and cache misses
count nothing here, so a change to I/O or memory traffic needs bench_planner as well. Under
valgrind a step runs some 50x slower: dp 16 and 10 steps take about 30 s a side.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bench_planner import ROWS, SEQ_LEN
from scripts.harness import ROOT, Figure, add_json_flag, commit_tree, write_results

# Run in the tree measured (its omniload and its bench_planner), from that tree's folder.
_CHILD = """
import sys, time
from scripts.bench_planner import HORIZON_BATCHES, stepper
from omniload.coordinator.spill import Spill
dp, steps, intake = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rings = [] if intake == "rings" else None
spill = Spill()
try:
    planner = stepper(dp, steps, rings, spill)
    for _ in range(HORIZON_BATCHES + 1):
        planner.next_step()
    time.process_time()  # callgrind writes out the set-up's counts here
    for _ in range(steps):
        assert planner.next_step() is not None, "the documents ran out"
    time.process_time()  # and the timed steps' here
finally:
    spill.close()
    for ring in rings or []:
        ring.close()
        ring.unlink()
"""
_TOTAL = re.compile(r"^(?:summary|totals):\s*(\d+)", re.MULTILINE)


def steps_instructions(out: Path) -> int:
    """The instructions between the two marks: callgrind's second dump of `out` (`out`.2)."""
    dumps = sorted(out.parent.glob(out.name + ".*"), key=lambda p: int(p.suffix[1:]))
    if len(dumps) != 2:
        raise RuntimeError(
            f"expected 2 callgrind dumps of {out} (before and after the steps), found {len(dumps)}"
            + (": is this Python stripped of its symbols (no time_process_time)?" if not dumps else "")
        )
    found = _TOTAL.search(dumps[1].read_text(errors="replace"))
    if found is None:
        raise RuntimeError(f"{dumps[1]}: no summary line")
    return int(found.group(1))


def count(tree: Path, dp: int, steps: int, intake: str, out: Path) -> int:
    """The instructions of `steps` steps of the planner in `tree`; callgrind writes to `out`.*."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--dump-before=time_process_time",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-c",
        _CHILD,
        str(dp),
        str(steps),
        intake,
    ]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the planner under callgrind failed in {tree}:\n{done.stderr[-2000:]}")
    return steps_instructions(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="a commit to count too (its tree in a temporary git worktree)")
    parser.add_argument("--dp", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--intake", choices=("memory", "rings"), default="memory")
    add_json_flag(parser)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("planner_instructions needs valgrind (apt install valgrind)")
    slots = args.dp * ROWS * SEQ_LEN
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="omniload-instructions-") as folder:
        if args.against:
            with commit_tree(args.against) as tree:
                counts[args.against] = count(tree, args.dp, args.steps, args.intake, Path(folder) / "against.out")
        counts["checkout"] = count(ROOT, args.dp, args.steps, args.intake, Path(folder) / "checkout.out")
    print(f"dp {args.dp}, {args.steps} steps, intake {args.intake}: instructions a step (a token slot)")
    for name, total in counts.items():
        print(f"{name:<12} {total / args.steps / 1e6:8.2f}M ({total / args.steps / slots:,.0f} a token slot)")
    figures = []
    if args.against:
        ratio = counts["checkout"] / counts[args.against]
        print(f"checkout / {args.against}: {ratio:.3f}")
        figures.append(
            Figure(
                f"planner instructions a step, dp {args.dp}, {args.intake} intake (issue 41: a 5x cut)",
                f"{ratio:.3f}x ({counts['checkout'] / args.steps / 1e6:.1f}M against "
                f"{counts[args.against] / args.steps / 1e6:.1f}M)",
                args.against,
            )
        )
    write_results(args.json, figures, {"dp": args.dp, "steps": args.steps, "intake": args.intake, "counts": counts})


if __name__ == "__main__":
    main()
