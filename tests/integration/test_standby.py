"""Hot standby coordinators (issue 11): kill -9 the primary, a standby takes over, the ranks go
on from their own positions and get exactly the batches of an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import omniload
from omniload.control import job_status
from omniload.coordinator.ha.lease import read_lease
from omniload.job import FENCED_EXIT
from tests.corpus import make_mixed_corpus, mixed_sources, source_flags
from tests.jobs import PROBE, ROOT, TORCHRUN, checkpointed_step, collect, run_ranks, start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
_STEPS = 60


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The spec, and what each rank of an uninterrupted run gets, by world size (computed once)."""
    root = tmp_path_factory.mktemp("standby")
    spec = {
        "sources": mixed_sources(make_mixed_corpus(root)),
        "seq_len": 64,
        "rows": 2,
        "workers": 2,
        "seed": 4,
        "epochs": 0,
        "steps": _STEPS,
    }
    runs: dict[int, list[dict]] = {}

    def reference(world: int) -> list[dict]:
        if world not in runs:
            runs[world] = run_ranks(spec, world=world, out_dir=root)
        return runs[world]

    return spec, reference


def _wait_for(what: str, check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} did not happen in {timeout:.0f}s")


def _kill_primary(folder: Path, at_least: int) -> int:
    """kill -9 the coordinator holding the lease once the folder is past `at_least` steps; its epoch."""
    _wait_for(f"step {at_least}", lambda: checkpointed_step(folder) >= at_least)
    held = read_lease(folder)
    psutil.Process(held.pid).send_signal(signal.SIGKILL)
    return held.epoch


def _open_gate(gate: Path, steps: int) -> None:
    """Let the ranks (PROBE_GATE) take their first `steps` steps."""
    written = gate.with_suffix(".new")
    written.write_text(str(steps))
    written.replace(gate)


def _polled(job: omniload.Job) -> bool:
    """One poll of the job, as `omniload launch` polls every 0.2 s (it raises once the job
    ended). The killed primary is replaced only by a poll that finds it reaped, which can come
    well after its standby took over (a killed process shows as a zombie before its parent can
    reap it)."""
    code = job.poll()
    assert code is None, f"the job ended with code {code}"
    return True


def _replace_lost(job: omniload.Job) -> None:
    """What `omniload launch` does every 0.2 s: a lost coordinator is replaced by a standby."""
    assert job.poll() is None, "the job ended"
    assert all(process.poll() is None for process in job.coordinators)


def _answers(addrs: str, token: str) -> bool:
    try:
        return bool(job_status(addrs, token, timeout=10))
    except omniload.OmniloadError:
        return False


def _assert_same(reference: list[dict], got: list[dict]) -> None:
    for rank, (ref, run) in enumerate(zip(reference, got)):
        assert run["steps"] == list(range(_STEPS)), f"rank {rank} missed or repeated steps"
        assert run["hashes"] == ref["hashes"], f"rank {rank}'s batches differ from the uninterrupted run"


def test_launch_standby_under_torchrun_survives_kill_9_of_the_primary(uninterrupted, tmp_path):
    spec, reference = uninterrupted
    folder = tmp_path / "ckpt"
    flags = source_flags(spec["sources"])
    launch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omniload.cli",
            "launch",
            *flags,
            "--seq-len",
            "64",
            "--rows",
            "2",
            "--workers",
            "2",
            "--seed",
            "4",
            "--epochs",
            "0",
            "--steps",
            str(_STEPS),
            "--checkpoint-dir",
            str(folder),
            "--snapshot-every",
            "20",
            "--standby",
            "1",
            "-q",
            "--",
            *TORCHRUN,
            "--nproc_per_node=2",
            str(PROBE),
            str(tmp_path / "out{rank}.json"),
        ],
        cwd=ROOT,
        env={**os.environ, "PROBE_STEP_S": "0.03"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        epoch = _kill_primary(folder, random.Random(os.getpid()).randint(15, 40))
        _, stderr = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    assert launch.returncode == 0, stderr[-3000:]
    got = [json.loads((tmp_path / f"out{rank}.json").read_text()) for rank in range(2)]
    _assert_same(reference(2), got)
    assert "takes over as the primary of epoch" in stderr and "starting a standby there" in stderr
    assert "(a hot standby)" in stderr  # it followed the log with its workers running: nothing to replay
    for run in got:  # the WELCOME names the coordinator that served the end: the promoted standby
        assert {k: run["served_by"][k] for k in ("role", "epoch")} == {"role": "promoted", "epoch": epoch + 1}
        assert run["served_by"]["pid"] == read_lease(folder).pid


def test_a_killed_standby_changes_nothing_and_a_second_primary_kill_is_survived(uninterrupted, tmp_path):
    """The standby is killed (replaced, unnoticed by the ranks), then the primary twice. The
    ranks go as far as a gate lets them, so each kill comes at the step chosen for it, however
    long a standby takes to start on a busy machine."""
    spec, reference = uninterrupted
    folder, gate = tmp_path / "ckpt", tmp_path / "gate"
    _open_gate(gate, 10)
    with omniload.Job({**spec, "checkpoint_dir": str(folder), "snapshot_every": 20}, standby=1) as job:
        assert len(job.addrs) == 2 and job.env()["OMNILOAD_ADDR"] == ",".join(job.addrs)
        ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.02", "PROBE_GATE": str(gate)})
        _wait_for("step 5", lambda: checkpointed_step(folder) >= 5)
        job.coordinators[1].send_signal(signal.SIGKILL)
        job.coordinators[1].wait()
        _replace_lost(job)
        killed = job.coordinators[0].pid
        _open_gate(gate, 20)
        first = _kill_primary(folder, 15)
        promoted = job.coordinators[1].pid
        # no poll before the takeover: a standby started at the killed primary's address could win it
        _wait_for("the takeover", lambda: read_lease(folder).epoch == first + 1 and job.poll() is None)
        _replace_lost(job)
        assert read_lease(folder).pid == promoted
        # `omniload status` with the ranks' address list finds the promoted standby once it listens
        _wait_for("status from the promoted standby", lambda: _answers(job.env()["OMNILOAD_ADDR"], job.token))
        # the second kill comes once a standby stands where the first primary was
        _wait_for("the killed primary's replacement", lambda: _polled(job) and job.coordinators[0].pid != killed)
        _open_gate(gate, 40)
        second = _kill_primary(folder, 35)
        _wait_for("the second takeover", lambda: _polled(job) and read_lease(folder).epoch == second + 1)
        last = read_lease(folder).pid  # a standby started at either address may win the second takeover
        _open_gate(gate, _STEPS)
        got = collect(ranks)
        log = "\n".join(job.log_tail())
    _assert_same(reference(2), got)
    assert second == first + 1 and log.count("takes over as the primary") == 2, log
    assert all(run["served_by"]["pid"] == last and run["served_by"]["epoch"] == second + 1 for run in got)


def test_a_primary_cut_off_from_the_folder_is_fenced_and_never_serves_beside_its_successor(uninterrupted, tmp_path):
    """SIGSTOP stands for a partition: the primary is alive but renews nothing. The standby
    takes over once the lease expires; when the old primary runs again it sees the higher
    epoch, stops serving, and its ranks move on: every step reaches every rank exactly once."""
    spec, reference = uninterrupted
    folder = tmp_path / "ckpt"
    with omniload.Job({**spec, "checkpoint_dir": str(folder), "snapshot_every": 20}, standby=1) as job:
        ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.03"})
        _wait_for("step 20", lambda: checkpointed_step(folder) >= 20)
        old = job.coordinators[0]
        old.send_signal(signal.SIGSTOP)
        try:
            _wait_for("the takeover", lambda: read_lease(folder).epoch == 2, timeout=30)
        finally:
            old.send_signal(signal.SIGCONT)
        assert old.wait(30) == FENCED_EXIT
        # the fenced primary's address gets a new standby; the promoted one may have ended the job
        assert job.poll() in (None, 0), "the job failed"
        got = collect(ranks)
        log = "\n".join(job.log_tail())
    _assert_same(reference(2), got)
    assert "its lease was not renewed" in log
    assert "stops serving: a standby took over as the primary of epoch 2" in log
    assert all(run["served_by"]["epoch"] == 2 for run in got)


def test_a_primary_killed_before_any_snapshot_is_taken_over_from_the_start(uninterrupted, tmp_path):
    """No snapshot yet, so the standby has nothing to follow hot: it starts its workers at the
    job's start when it takes over, and the ranks, which never reached the primary, find it."""
    spec, reference = uninterrupted
    folder = tmp_path / "ckpt"
    with omniload.Job({**spec, "checkpoint_dir": str(folder)}, standby=1) as job:
        job.coordinators[0].send_signal(signal.SIGKILL)
        got = collect(start_ranks(job, 2, tmp_path))
        log = "\n".join(job.log_tail())
    _assert_same(reference(2), got)
    assert "takes over as the primary of epoch 2" in log and "(a hot standby)" not in log
