"""What the benchmarks share: where the repository is, what their child processes import, the
commit and machine a figure was measured on, and their results as JSON.

A benchmark adds `--json` with `add_json_flag` and ends with `write_results(args.json, figures,
raw)`: `figures` are rows of docs/benchmarks.md's summary table (what is measured, the value,
the baseline), `raw` whatever numbers the script measured. The command, commit, date and
machine are filled in here, so a row says where it came from without anyone copying it by
hand; `python -m scripts.render_results FILE...` writes the rows into the document.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def children_import_scripts() -> None:
    """Let the processes a benchmark starts (torchrun's ranks, omniload's workers, spawned
    children) import `scripts.*` and `tests.*` as the benchmark itself does: the repository
    goes first on their PYTHONPATH. A tokenizer named `scripts.bench_autoscale:costly` is
    imported by the workers, so they need it too."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), *paths]))


def commit() -> str:
    """The checkout's short commit, '+' when code differs from it (docs do not count: rendering
    results edits them); '?' outside git."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    if head.returncode:
        return "?"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def machine() -> str:
    """The summary table's machine cell: cores as this process may use them."""
    return f"{len(os.sched_getaffinity(0))} cores"


@dataclass(frozen=True, slots=True)
class Figure:
    """One row of the summary table: `figure` names what is measured and its target, as the
    row's first cell does (the renderer finds the row by it), `value` and `baseline` are the
    next two cells."""

    figure: str
    value: str
    baseline: str = "none"


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", type=Path, help="write the results here (python -m scripts.render_results reads them)"
    )


@contextlib.contextmanager
def commit_tree(commit: str) -> Iterator[Path]:
    """`commit`'s tree in a temporary git worktree, removed after (a benchmark's A/B side: its
    processes import omniload from there with PYTHONPATH at it)."""
    with tempfile.TemporaryDirectory(prefix="omniload-against-") as folder:
        tree = Path(folder) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True)
        try:
            yield tree
        finally:  # (never hiding the caller's own error: a failed removal is pruned)
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=False)


def command_line() -> str:
    """How this benchmark was run, as a reader would type it (less where its results went)."""
    args, kept = sys.argv[1:], []
    while args:
        arg = args.pop(0)
        if arg == "--json":
            args = args[1:]
        elif not arg.startswith("--json="):
            kept.append(arg)
    return shlex.join(["python", "-m", f"scripts.{Path(sys.argv[0]).stem}", *kept])


def write_results(
    path: Path | None, figures: list[Figure], raw: dict[str, Any] | None = None, measured: dict[str, str] | None = None
) -> None:
    """Write the run's figures and raw numbers to `path` (nothing when it is None). `measured`
    overrides where the figures were measured (commit, date, machine) when they are not this
    run's: a merge of earlier runs names theirs."""
    if path is None:
        return
    results = {
        **(raw or {}),  # first: the raw numbers never hide where they were measured
        "command": command_line(),
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        **(measured or {}),
        "figures": [dataclasses.asdict(f) for f in figures],
    }
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {path}")


def low_high(values: list[float], fmt: str) -> str:
    """'a' or 'a-b': the least and the most of `values`, each as format(v, fmt) writes it."""
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def min_median_max(values: list[float], fmt: str) -> str:
    """'min/median/max' of `values`, each as format(v, fmt) writes it."""
    return "/".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))
