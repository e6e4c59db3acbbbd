"""Write benchmark results into docs/benchmarks.md's summary table: the one way a figure gets there.

    python -m scripts.bench_planner --dp 64 --steps 20 --json planner.json
    python -m scripts.render_results planner.json [more.json ...] [--doc docs/benchmarks.md]

Each figure of a results file (scripts/harness.py's write_results) becomes a row: what is
measured, the value, the baseline, then the command, commit, date and machine of its run. A row
whose first cell is the figure's is replaced; a figure with no row is refused, unless `--add`
adds it at the table's end. Rows no
file names stay as they are: the summary also holds figures gathered over several runs by hand,
which say so in their cells. `--check` prints the rows without writing the document; `--only
TEXT` renders only the figures whose name holds TEXT (a figure measured while the machine was
busy is better left out than written).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scripts.harness import ROOT

HEADER = "| figure (target) | value | baseline | command | commit | date | machine |"
_SEPARATOR = "|---|---|---|---|---|---|---|"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def row_of(results: dict, figure: dict) -> str:
    cells = [
        figure["figure"],
        figure["value"],
        figure.get("baseline", "none"),
        f"`{results['command']}`",
        results["commit"],
        results["date"],
        results["machine"],
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def first_cell(row: str) -> str:
    """A table row's first cell, as written (escaped bars kept)."""
    body = row.strip()[1:]
    at = 0
    while True:
        bar = body.find("|", at)
        if bar < 0 or body[bar - 1] != "\\":
            return body[:bar].strip()
        at = bar + 1


def render(document: str, rows: list[str], add: bool = False) -> tuple[str, list[str]]:
    """The document with `rows` written into its summary table; and what was done, a line a row.
    A figure with no row of its own is refused unless `add`: a figure named a little differently
    from its row would otherwise sit beside it, the two saying different things."""
    lines = document.split("\n")
    try:
        top = lines.index(HEADER)
    except ValueError:
        raise SystemExit(f"no summary table (a line '{HEADER}') in the document") from None
    if lines[top + 1] != _SEPARATOR:
        raise SystemExit(f"the summary table's header is not followed by '{_SEPARATOR}'")
    end = top + 2
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    table = lines[top + 2 : end]
    done = []
    for row in rows:
        key = first_cell(row)
        found = [i for i, old in enumerate(table) if first_cell(old) == key]
        if len(found) > 1:
            raise SystemExit(f"{len(found)} rows of the summary table are '{key}': keep one")
        if found:
            table[found[0]] = row
            done.append(f"replaced: {key}")
        elif add:
            table.append(row)
            done.append(f"added: {key}")
        else:
            raise SystemExit(
                f"no row of the summary table is '{key}': --add to add it, or --only the figures whose rows exist"
            )
    return "\n".join([*lines[: top + 2], *table, *lines[end:]]), done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="files a benchmark's --json wrote")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--check", action="store_true", help="print the rows; write nothing")
    parser.add_argument("--add", action="store_true", help="add the figures that have no row yet at the table's end")
    parser.add_argument(
        "--only", action="append", default=[], help="render only the figures whose name holds this text (repeatable)"
    )
    args = parser.parse_args()
    rows = []
    for path in args.results:
        results = json.loads(path.read_text())
        if not results.get("figures"):
            raise SystemExit(f"{path}: no figures (a benchmark's --json file has a 'figures' list)")
        chosen = [f for f in results["figures"] if not args.only or any(text in f["figure"] for text in args.only)]
        rows.extend(row_of(results, figure) for figure in chosen)
    if not rows:
        raise SystemExit(f"no figure's name holds {' or '.join(map(repr, args.only))}")
    if args.check:
        print("\n".join(rows))
        return
    document, done = render(args.doc.read_text(), rows, args.add)
    args.doc.write_text(document)
    print("\n".join(done))


if __name__ == "__main__":
    main()
