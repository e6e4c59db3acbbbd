"""However a job ends, no segment, worker or port is left behind (docs/architecture.md,
Invariants, "Nothing left behind")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

import omniload
from omniload.formats.ring import job_segments
from tests.corpus import mixed_sources, source_flags
from tests.jobs import PROBE, ROOT, alive, workers_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _wait_gone(pids: list[int], seconds: float = 15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def _endless_launch(corpus, tmp_path) -> subprocess.Popen:
    args = ["launch", "--seq-len", "64", "--workers", "3", "--epochs", "0", *source_flags(mixed_sources(corpus))]
    return subprocess.Popen(
        [sys.executable, "-m", "omniload.cli", *args, "--", sys.executable, str(PROBE), str(tmp_path / "out.json")],
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, "PROBE_STEP_S": "0.02"},
        stderr=subprocess.PIPE,
        text=True,
    )


def _tree(process: subprocess.Popen, at_least: int) -> list[int]:
    """Pids under the launcher once the job is running (coordinator, forkserver, workers, rank)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        if len(pids) >= at_least:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"the job did not start: {len(pids)} processes")


def test_ctrl_c_stops_everything(corpus, tmp_path):
    launcher = _endless_launch(corpus, tmp_path)
    pids = _tree(launcher, at_least=7)  # coordinator, tracker, forkserver, 3 workers, rank
    time.sleep(1.0)
    os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, stderr
    assert _wait_gone(pids) == []


def test_killed_launcher_takes_the_coordinator_and_workers_with_it(corpus, tmp_path):
    launcher = _endless_launch(corpus, tmp_path)
    pids = _tree(launcher, at_least=7)
    launcher.kill()
    launcher.wait()
    assert _wait_gone(pids, 30) == [], "orphans survived the launcher"


def test_killed_coordinator_takes_its_workers_and_the_next_job_removes_its_segments(corpus, tmp_path):
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "workers": 3, "epochs": 0}
    dead = omniload.Job(spec).start()
    workers = [w.pid for w in workers_of(dead)]
    assert len(workers) == 3 and job_segments(dead.job_id)
    os.kill(dead._process.pid, signal.SIGKILL)
    dead.wait(10)
    assert _wait_gone(workers) == [], "workers outlived their coordinator"
    # (its segments outlive it; in a parallel run another test's new job may remove them first)
    with omniload.Job(spec):
        assert job_segments(dead.job_id) == [], "a new job removes a dead job's segments"
    dead.stop()
