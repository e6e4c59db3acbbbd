"""The one way a benchmark's figure reaches docs/benchmarks.md: its row is found by what it
measures and replaced whole, a new figure is added, and nothing else in the document moves."""

from __future__ import annotations

import pytest

from scripts.render_results import HEADER, first_cell, render, row_of

_DOC = f"""# Benchmarks

{HEADER}
|---|---|---|---|---|---|---|
| planner CPU a token slot, dp 64 (≤ 10 ns) | 52-78 ns | none | `old` | abc1234 | 2026-11-01 | 2 cores |
| a \\| figure with a bar | 1 | none | `x` | abc1234 | 2026-11-01 | 2 cores |

## Method

text
"""
_RESULTS = {"command": "python -m scripts.bench_planner --dp 64", "commit": "def5678", "date": "2026-11-28"}


def _row(figure: str, value: str) -> str:
    return row_of({**_RESULTS, "machine": "2 cores"}, {"figure": figure, "value": value, "baseline": "none"})


def test_a_figure_replaces_its_own_row_and_a_new_one_is_added_only_when_asked():
    rows = [_row("planner CPU a token slot, dp 64 (≤ 10 ns)", "39-49 ns"), _row("a new figure", "7")]
    with pytest.raises(SystemExit, match="no row of the summary table is 'a new figure': --add"):
        render(_DOC, rows)
    document, done = render(_DOC, rows, add=True)
    assert done == ["replaced: planner CPU a token slot, dp 64 (≤ 10 ns)", "added: a new figure"]
    lines = document.split("\n")
    table = lines[lines.index(HEADER) + 2 : lines.index(HEADER) + 5]
    assert table == [
        "| planner CPU a token slot, dp 64 (≤ 10 ns) | 39-49 ns | none | `python -m scripts.bench_planner --dp 64` "
        "| def5678 | 2026-11-28 | 2 cores |",
        "| a \\| figure with a bar | 1 | none | `x` | abc1234 | 2026-11-01 | 2 cores |",
        "| a new figure | 7 | none | `python -m scripts.bench_planner --dp 64` | def5678 | 2026-11-28 | 2 cores |",
    ]
    assert document.endswith("## Method\n\ntext\n"), "the rest of the document is left as it was"


def test_a_figure_with_a_bar_in_its_name_finds_its_row():
    assert first_cell("| a \\| figure with a bar | 1 | none |") == "a \\| figure with a bar"
    document, done = render(_DOC, [_row("a | figure with a bar", "2")])
    assert done == ["replaced: a \\| figure with a bar"] and "| a \\| figure with a bar | 2 |" in document


def test_two_rows_of_one_figure_are_refused_rather_than_one_picked():
    doubled = _DOC.replace("## Method", "").replace(
        "| a \\| figure", "| planner CPU a token slot, dp 64 (≤ 10 ns) | 1 | none | `y` | a | b | c |\n| a \\| figure"
    )
    with pytest.raises(SystemExit, match="2 rows of the summary table"):
        render(doubled, [_row("planner CPU a token slot, dp 64 (≤ 10 ns)", "1")])
