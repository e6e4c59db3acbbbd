"""Shared fixtures. Every test ends with the check of DESIGN.md invariant 3: no shared-memory
segment of ours and no child process of the test left behind."""
from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from omniload.workers.ring import PREFIX, SHM_DIR

_GRACE_S = 10.0


def _our_segments() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}*"))


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = set(_our_segments())
    yield
    me = psutil.Process()
    deadline = time.monotonic() + _GRACE_S
    while time.monotonic() < deadline:
        children = [c for c in me.children(recursive=True) if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        leftover = set(_our_segments()) - before
        if not children and not leftover:
            return
        time.sleep(0.1)
    for child in children:  # do not let one leak cascade into the next test
        child.kill()
    assert not children, f"processes left behind: {[(c.pid, c.cmdline()) for c in children]}"
    assert not leftover, f"shared-memory segments left behind: {sorted(leftover)}"


@pytest.fixture
def corpus(tmp_path: Path):
    from tests.corpus import make_mixed_corpus

    return make_mixed_corpus(tmp_path)
