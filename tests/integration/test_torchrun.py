"""A real torchrun training (gloo, CPU) through `omniload launch`, as `omniload demo` runs it."""

from __future__ import annotations

import re

import pytest

from tests.jobs import omniload_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_demo_trains_two_ranks_and_the_loss_decreases(tmp_path):
    result = omniload_cli("demo", "--steps", "30", "--dir", str(tmp_path), timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = re.findall(r"^step +(\d+) +loss ([\d.]+) +tokens/s +(\d+) +data wait ([\d.]+)%", result.stdout, re.M)
    assert len(steps) == 30
    summary = re.search(r"loss ([\d.]+) -> ([\d.]+) \(decreased\)", result.stdout)
    assert summary, result.stdout[-2000:]
    first, final = map(float, summary.groups())
    assert final < first - 0.5, "the model learned from the data it was given"
