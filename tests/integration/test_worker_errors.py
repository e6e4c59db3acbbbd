"""Issue 10, the worker side: a worker's error names source, file and cause; a /dev/shm too
small for the rings is a startup error; `omniload launch` returns with no process of its job left."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import omniload
from tests.corpus import mixed_sources, source_flags, write_jsonl
from tests.jobs import PROBE, ROOT, alive, collect, start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def importable_tests(monkeypatch):
    """Workers import the user's transform module; make `tests.*` importable there."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _token_ids_source(root: Path) -> dict:
    """A pre-tokenized JSON-lines source: good.jsonl (100 rows) and bad.jsonl, whose row 21
    holds strings where token ids belong (the index checks only the first row)."""
    docs = [list(range(i, i + 3 + i % 5)) for i in range(100)]
    write_jsonl(root / "ids" / "good.jsonl", docs, column="ids")
    bad = docs[:50]
    bad[20] = ["a", "b"]
    write_jsonl(root / "ids" / "bad.jsonl", bad, column="ids")
    return {"name": "ids", "path": str(root / "ids" / "*.jsonl"), "column": "ids"}


def _run_one_rank_to_its_error(job: omniload.Job, out_dir: Path, code: int = 1) -> tuple[str, str]:
    """The rank's stderr and the coordinator's log once the job has failed."""
    ((rank, _),) = start_ranks(job, 1, out_dir)
    _, stderr = rank.communicate(timeout=60)
    assert rank.returncode != 0, "the rank should have got the job's error"
    assert job.wait(30) == code
    return stderr, "\n".join(job.log_tail())


def test_unreadable_rows_stop_the_job_naming_source_file_and_cause(tmp_path):
    spec = {"sources": [_token_ids_source(tmp_path)], "seq_len": 32, "rows": 2}
    with omniload.Job(spec) as job:
        # a bad file is bad input (exit code 2), whether found at startup or part-way
        stderr, log = _run_one_rank_to_its_error(job, tmp_path, code=2)
    for seen in (stderr, log):
        assert "source 'ids'" in seen and f"{tmp_path}/ids/bad.jsonl" in seen, seen
        assert "ValueError: invalid literal for int() with base 10: 'a'" in seen, seen
        assert "--on-bad-file skip" in seen, seen
    assert "exited with code" not in log, "the worker reports the error; it must not crash on it"


def test_unreadable_file_is_skipped_under_on_bad_file_skip(tmp_path):
    spec = {"sources": [_token_ids_source(tmp_path)], "seq_len": 32, "rows": 2, "on_bad_file": "skip"}
    with omniload.Job(spec) as job:
        (rank,) = collect(start_ranks(job, 1, tmp_path))
        log = "\n".join(job.log_tail())
    assert len(rank["sample_ids"]) == 100, "every row of good.jsonl once, none of bad.jsonl"
    assert "source 'ids'" in log and f"skipped 50 rows: {tmp_path}/ids/bad.jsonl" in log, log
    assert "ValueError: invalid literal for int()" in log, log


def test_tokenizer_that_fails_to_load_in_the_worker_stops_the_job_naming_it(corpus, tmp_path, importable_tests):
    sources = mixed_sources(corpus)
    sources[1]["tokenizer"] = "tests.transform_fails_in_worker:tokenize"  # imports in the coordinator only
    spec = {"sources": sources, "seq_len": 64, "workers": 3}
    with omniload.Job(spec) as job:
        stderr, log = _run_one_rank_to_its_error(job, tmp_path)
    for seen in (stderr, log):
        assert "source 'code'" in seen and "tests.transform_fails_in_worker:tokenize" in seen, seen
        assert "RuntimeError: no tokenizer model in this process" in seen, seen
    assert "exited with code" not in log, "the worker reports the error; it must not crash on it"


def test_worker_that_fails_outside_any_shard_says_why_before_exiting(tmp_path):
    ring = tmp_path / "no-such-ring"  # attaching to it fails before any shard is read
    script = f"""
from omniload.formats.lane_config import LaneConfig, WorkerConfig
from omniload.workers.worker import run_worker
lane = LaneConfig(source_index=0, source_name="web", column="text", tokenizer="bytes", lane=0, num_lanes=1,
                  ring_path={str(ring)!r}, shards=(), seed=0, epochs=1, interleave=1, start_group=0,
                  start_pos=0, skip_bad_files=False)
run_worker(WorkerConfig(worker_id=0, coordinator_pid={os.getpid()}, lanes=(lane,)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]  # what the coordinator's log shows above "exited with code 1"
    assert last.startswith("omniload: worker ") and "for source 'web' failed: FileNotFoundError" in last, last
    assert str(ring) in last, last


def test_a_failing_workers_traceback_is_redacted_as_the_coordinators_log_is(tmp_path):
    """A store's error may quote a key or a signed URL: what the worker prints on its way out
    goes through the same redaction as every line of the coordinator's log."""
    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY"
    ring = tmp_path / f"ring-{secret}"
    script = f"""
from omniload.formats.lane_config import LaneConfig, WorkerConfig
from omniload.workers.worker import run_worker
lane = LaneConfig(source_index=0, source_name="web", column="text", tokenizer="bytes", lane=0, num_lanes=1,
                  ring_path={str(ring)!r}, shards=(), seed=0, epochs=1, interleave=1, start_group=0,
                  start_pos=0, skip_bad_files=False)
run_worker(WorkerConfig(worker_id=0, coordinator_pid={os.getpid()}, lanes=(lane,)))
"""
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": secret}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1 and "Traceback" in result.stderr, result.stderr
    assert secret not in result.stderr and "ring-***" in result.stderr.splitlines()[-1], result.stderr


def _private_small_shm_or_skip() -> None:
    try:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=2m tmpfs /dev/shm"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError:
        pytest.skip("needs unshare(1) to give the job its own small /dev/shm")
    if probe.returncode != 0:
        pytest.skip(
            f"needs a private mount namespace with a tmpfs on /dev/shm (root or user namespaces): "
            f"{probe.stderr.strip()}"
        )


def _launch_args(corpus: dict[str, str], *flags_then_cmd: str) -> list[str]:
    args = [sys.executable, "-m", "omniload.cli", "launch", "--seq-len", "64", *source_flags(mixed_sources(corpus))]
    return args + list(flags_then_cmd)


def test_too_small_dev_shm_is_a_clear_startup_error(corpus):
    _private_small_shm_or_skip()
    launch = shlex.join(_launch_args(corpus, "--workers", "4", "--ring-mb", "1", "--", sys.executable, "-c", "pass"))
    # a 2 MB /dev/shm seen by this job only; 4 lanes of 1 MB do not fit, the first one does
    script = f"mount -t tmpfs -o size=2m tmpfs /dev/shm && {launch}; code=$?; echo left: $(ls -A /dev/shm); exit $code"
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert "/dev/shm is too small for this job's rings: it holds 2.0 MB" in result.stderr, result.stderr
    assert "4 lanes x --ring-mb 1" in result.stderr and "--shm-size" in result.stderr, result.stderr
    assert "lower --ring-mb / --workers" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout.split() == ["left:"], "the rings created before the failure must be unlinked"


def test_launch_returns_only_after_every_process_of_its_job_is_gone(corpus, tmp_path):
    # workers still producing at the end (epochs 0), a rank that reads to the end (--steps)
    args = _launch_args(
        corpus,
        "--workers",
        "3",
        "--epochs",
        "0",
        "--steps",
        "30",
        "--",
        sys.executable,
        str(PROBE),
        str(tmp_path / "out.json"),
    )
    with open(tmp_path / "launch.err", "w") as err:
        launcher = subprocess.Popen(args, cwd=ROOT, stderr=err)
        seen, at_coordinator_exit = _watch(launcher)
    left = [cmd for pid, cmd in seen.items() if alive(pid)]  # checked at once: no grace period
    assert launcher.returncode == 0, (tmp_path / "launch.err").read_text()
    assert len(seen) >= 7, f"expected coordinator, tracker, forkserver, 3 workers and the rank: {seen}"
    assert at_coordinator_exit == [], f"alive when the coordinator exited: {at_coordinator_exit}"
    assert left == [], f"alive when omniload launch returned: {left}"


def _watch(launcher: subprocess.Popen) -> tuple[dict[int, str], list[str] | None]:
    """Until the launcher exits: every process it started (pid -> command line), and those of
    the coordinator's descendants still alive right after the coordinator exited (None if that
    moment was missed)."""
    seen: dict[int, str] = {}
    under_coordinator: dict[int, str] = {}
    coordinator, at_coordinator_exit = None, None
    while launcher.poll() is None:
        seen.update(_descendants(launcher.pid))
        coordinator = coordinator or next((pid for pid, cmd in seen.items() if "omniload.coordinator" in cmd), None)
        if coordinator and at_coordinator_exit is None:
            if alive(coordinator):
                under_coordinator.update(_descendants(coordinator))
            else:
                at_coordinator_exit = [cmd for pid, cmd in under_coordinator.items() if alive(pid)]
        time.sleep(0.01)
    return seen, at_coordinator_exit


def _descendants(pid: int) -> dict[int, str]:
    try:
        return {p.pid: " ".join(p.cmdline()) for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {}
