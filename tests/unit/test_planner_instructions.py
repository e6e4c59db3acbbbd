"""planner_instructions reads the timed steps' count: callgrind's second dump, not the set-up's or the whole run's."""

import pytest

from scripts.planner_instructions import steps_instructions


def _dump(path, total):
    path.write_text(f"# callgrind format\nversion: 1\nevents: Ir\nsummary: {total}\n\nfn=main\n0 {total}\n")


def test_the_steps_count_is_the_second_dump(tmp_path):
    out = tmp_path / "checkout.out"
    _dump(tmp_path / "checkout.out.1", 1_400_000_000)  # the set-up: imports, documents, the fill
    _dump(tmp_path / "checkout.out.2", 238_657_665)  # between the two marks
    _dump(tmp_path / "checkout.out.10", 5)  # a stray later dump would be a third mark: refused below
    with pytest.raises(RuntimeError, match="expected 2 callgrind dumps"):
        steps_instructions(out)
    (tmp_path / "checkout.out.10").unlink()
    _dump(out, 9)  # the run's rest, written at exit under the bare name
    assert steps_instructions(out) == 238_657_665


def test_a_dump_without_its_summary_is_an_error_naming_it(tmp_path):
    out = tmp_path / "checkout.out"
    _dump(tmp_path / "checkout.out.1", 1)
    (tmp_path / "checkout.out.2").write_text("events: Ir\n")
    with pytest.raises(RuntimeError, match=r"checkout\.out\.2: no summary line"):
        steps_instructions(out)
