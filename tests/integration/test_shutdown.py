"""However a job ends, no segment, worker or port is left behind (docs/architecture.md,
Invariants, "Nothing left behind")."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

import omniload
from omniload.errors import OmniloadError
from omniload.formats.ring import job_segments
from tests.corpus import mixed_sources, source_flags
from tests.jobs import PROBE, ROOT, alive, workers_of
from tests.s3_store import FaultyProxy

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


@pytest.fixture
def slow_bucket(s3, tmp_path, monkeypatch):
    """64 one-line objects behind a proxy holding each request 3 s: a listing, then two requests
    an object 32 at a time, so the index takes some 15 s. Yields (source spec, proxy)."""
    folder = tmp_path / "slow" / "data"
    folder.mkdir(parents=True)
    for i in range(64):
        (folder / f"part-{i:03d}.jsonl").write_text(json.dumps({"text": f"document {i}"}) + "\n")
    s3.upload("slow", tmp_path / "slow")
    proxy = FaultyProxy(s3.port, delay_s=3.0)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield {"sources": [{"name": "slow", "path": "s3://slow/data/*.jsonl"}], "seq_len": 64, "workers": 1}, proxy
    finally:
        proxy.close()


def test_a_coordinator_killed_while_it_indexes_a_bucket_takes_its_indexing_child(slow_bucket):
    """The indexing child lists and reads the store for as long as the index takes (minutes at
    10^5 objects) and its parent is the forkserver: a coordinator killed meanwhile (SIGKILL, a
    Job's startup timeout) must take it, and the forkserver with it, not leave them indexing."""
    spec, proxy = slow_bucket
    job = omniload.Job(spec)
    starting = threading.Thread(target=_start_failing, args=(job,), daemon=True)
    try:
        starting.start()
        deadline = time.monotonic() + 30
        while not sum(proxy.requests.values()):  # the child asks the store once it is indexing
            assert time.monotonic() < deadline, "the indexing child never asked the store"
            time.sleep(0.1)
        pids = [p.pid for p in psutil.Process(job._process.pid).children(recursive=True)]
        assert any(psutil.Process(pid).ppid() != job._process.pid for pid in pids), "no indexing child"
        os.kill(job._process.pid, signal.SIGKILL)
        assert _wait_gone(pids, 5) == [], "the indexing child or the forkserver outlived the coordinator"
    finally:
        starting.join(30)
        job.stop()


def test_a_start_past_its_timeout_names_the_fix_and_leaves_nothing(slow_bucket):
    """A Job whose coordinator is still indexing at its startup timeout says why and what to do,
    and stops every process of the job (the conftest's check: none left, no segment)."""
    spec, _ = slow_bucket
    started = time.monotonic()
    with pytest.raises(OmniloadError, match=r"not ready after 2s.*startup_timeout=SECONDS.*--cache-dir"):
        omniload.Job(spec, startup_timeout=2).start()
    assert time.monotonic() - started < 15, "the timeout waited for the index"


def _start_failing(job: omniload.Job) -> None:
    with contextlib.suppress(OmniloadError):  # it never gets ready: its coordinator is killed
        job.start()


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
