"""Failure modes as ordinary cases: dead workers, stuck transforms, bad clients (docs/architecture.md,
Invariants: exactly once, never hang silently)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from pathlib import Path

import psutil
import pytest
import torch

import omniload
from tests.corpus import mixed_sources
from tests.jobs import ROOT, collect, run_ranks, start_ranks, wait_for_status, workers_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
def importable_tests(monkeypatch):
    """Workers import the user's transform module; make `tests.*` importable there."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _slow_endless_job(corpus) -> dict:
    """80 steps of workers that never finish on their own (epochs=0), slow enough to be killed
    mid-run, with 1 MB rings."""
    return {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "rows": 2,
        "workers": 3,
        "seed": 2,
        "epochs": 0,
        "steps": 80,
        "tokenizer": "tests.transforms_for_tests:slow_bytes",
        "ring_mb": 1,
    }


def test_killed_worker_is_replaced_with_nothing_lost_or_repeated(corpus, tmp_path, importable_tests):
    spec = _slow_endless_job(corpus)
    reference = run_ranks(spec, world=2, out_dir=tmp_path)
    with omniload.Job(spec) as job:
        ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.05"})  # ~4 s of "training"
        wait_for_status(job, lambda s: s["steps"]["slowest"] >= 20, "20 steps consumed")  # mid-run (epochs=0)
        victims = workers_of(job)
        assert victims, "no worker processes found"
        for victim in victims[:2]:
            victim.send_signal(signal.SIGKILL)
        crashed = collect(ranks)
        log = "\n".join(job.log_tail())
    assert log.count("was killed by SIGKILL; restarting it at the source cursor") == 2, log
    for rank in range(2):
        assert crashed[rank]["hashes"] == reference[rank]["hashes"], f"rank {rank} saw different data after the crash"


def _corrupt_an_unread_record(job: omniload.Job, timeout: float = 60) -> str:
    """Flip a payload byte of the record a ring's reader takes next, once the planner waits for
    the ranks (the read position holds still): a record torn in shared memory. The ring's name."""
    from omniload.formats.ring import FRAME, job_segments

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in job_segments(job.job_id):
            with open(path, "r+b", buffering=0) as segment:  # unbuffered: every read sees the ring now
                header = segment.read(128)
                write, capacity, read = (struct.unpack_from("<Q", header, at)[0] for at in (0, 8, 64))
                if write == read:
                    continue
                time.sleep(0.3)
                segment.seek(64)
                if struct.unpack("<Q", segment.read(8))[0] != read:
                    continue  # the planner is reading this ring: not waiting
                offset = read % capacity
                segment.seek(128 + offset)
                if struct.unpack("<Q", segment.read(8))[0] == (1 << 64) - 1:
                    offset = 0  # padding to the end: the record is at the start
                at = 128 + (offset + FRAME + 3) % capacity
                segment.seek(at)
                byte = segment.read(1)[0]
                segment.seek(at)
                segment.write(bytes([byte ^ 0x20]))
                return path.name
        time.sleep(0.05)
    raise AssertionError(f"no ring held an unread record while the planner waited, in {timeout:.0f}s")


def test_a_record_that_fails_its_checks_replaces_the_worker_and_changes_no_batch(corpus, tmp_path, importable_tests):
    """A torn record is never taken: the lane's worker is replaced and the ring reset, as for a
    dead worker, and the ranks get the batches of an undisturbed run."""
    spec = {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "rows": 2,
        "workers": 3,
        "seed": 2,
        "epochs": 0,
        "steps": 150,
        "shuffle_window": 16,  # a short horizon: the planner reads as it delivers
        "plan_ahead": 2,
        "ring_mb": 1,
    }
    reference = run_ranks(spec, world=2, out_dir=tmp_path)
    with omniload.Job(spec) as job:  # slow ranks: the planner waits for them, the rings stay full
        ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.05", "PROBE_SLOW_AFTER": "5"})
        ring = _corrupt_an_unread_record(job)
        results = collect(ranks)
        log = "\n".join(job.log_tail())
    assert f"ring {ring}: record" in log and "fails its digest" in log, log
    assert log.count("stopped; restarting it at the source cursor (restart 1 of") == 1, log
    for rank in range(2):
        assert results[rank]["hashes"] == reference[rank]["hashes"], f"rank {rank} saw other batches"


class _MemoryCgroup:
    """A memory cgroup of `limit` bytes of our own (v1 or v2), or a reason why there is none."""

    def __init__(self, limit: int) -> None:
        self.path: Path | None = None
        self.why = ""
        for root, limit_file, swap_file in (
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
            ("/sys/fs/cgroup", "memory.max", "memory.swap.max"),
        ):
            folder = Path(root) / f"omniload-test-{os.getpid()}"
            try:
                folder.mkdir()
            except OSError as exc:
                self.why = f"cannot make a cgroup under {root}: {exc.strerror}"
                continue
            try:
                (folder / limit_file).write_text(str(limit))
            except OSError as exc:
                folder.rmdir()
                self.why = f"cannot limit a cgroup's memory under {root}: {exc.strerror}"
                continue
            try:  # with swap, the kernel would page the process out rather than kill it
                (folder / swap_file).write_text(str(limit) if swap_file.startswith("memory.memsw") else "0")
            except OSError:
                pass  # no swap accounting: with no swap on, nothing to limit
            self.path = folder
            return

    def add(self, pid: int) -> None:
        assert self.path is not None
        (self.path / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int | None:
        """How many processes the kernel's OOM killer ended in this cgroup; None where the
        kernel does not count them (before Linux 4.13)."""
        assert self.path is not None
        for name in ("memory.events", "memory.oom_control"):  # v2, v1
            try:
                lines = (self.path / name).read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return None

    def remove(self) -> None:
        if self.path is not None:
            for _ in range(50):  # the killed process leaves it a moment after its death
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


def test_a_worker_the_oom_killer_ends_is_replaced_and_changes_no_batch(corpus, tmp_path, importable_tests):
    """A worker over its memory limit (here: moved into a cgroup of 1 MB) is SIGKILLed by the
    kernel; it is replaced at the cursor like any dead worker, and the batches do not change."""
    cgroup = _MemoryCgroup(1 << 20)
    if cgroup.path is None:
        pytest.skip(cgroup.why)
    spec = _slow_endless_job(corpus)
    try:
        reference = run_ranks(spec, world=2, out_dir=tmp_path)
        with omniload.Job(spec) as job:
            ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.05"})
            while not (workers := workers_of(job)):
                time.sleep(0.05)
            victim = workers[0]
            cgroup.add(victim.pid)  # its next pages are charged to the cgroup: the OOM killer ends it
            _, survived = psutil.wait_procs([victim], timeout=30)
            killed = cgroup.oom_kills()
            results = collect(ranks)
            log = "\n".join(job.log_tail())
    finally:
        cgroup.remove()
    # what is tested is omniload's answer to the kill, not the kernel's policy: a kernel that pages the
    # worker out instead (swap without accounting) lets the ranks finish and the job stop the worker
    if survived or killed == 0:
        pytest.skip("the kernel did not OOM-kill a worker in a 1 MB cgroup within 30 s (swap without accounting?)")
    assert f"worker {victim.pid} for source" in log and "was killed by SIGKILL; restarting it" in log, log
    for rank in range(2):
        assert results[rank]["hashes"] == reference[rank]["hashes"], f"rank {rank} saw other batches"


def test_worker_that_keeps_exiting_stops_the_job_naming_source_and_exit_code(corpus, tmp_path, importable_tests):
    sources = mixed_sources(corpus)
    sources[1]["tokenizer"] = "tests.transforms_for_tests:exit3"
    spec = {"sources": sources, "seq_len": 64, "workers": 3, "max_restarts": 1}
    with omniload.Job(spec) as job:
        assert job.wait(60) == 1
        log = "\n".join(job.log_tail())
    assert "source 'code'" in log and "exited with code 3" in log and "--max-restarts" in log


def test_stuck_transform_fails_after_the_worker_timeout(corpus, tmp_path, importable_tests):
    sources = mixed_sources(corpus)
    sources[2]["tokenizer"] = "tests.transforms_for_tests:hang"
    spec = {"sources": sources, "seq_len": 64, "workers": 3, "worker_timeout": 3}
    with omniload.Job(spec) as job:
        ((rank, out),) = start_ranks(job, 1, tmp_path)
        _, stderr = rank.communicate(timeout=60)
        assert rank.returncode != 0
        assert "source 'books'" in stderr and "is a transform stuck" in stderr


def test_transform_error_reaches_the_rank_with_file_and_cause(corpus, tmp_path, importable_tests):
    spec = {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "workers": 3,
        "tokenizer": "tests.transforms_for_tests:fail_on_seven",
    }
    with omniload.Job(spec) as job:
        ((rank, out),) = start_ranks(job, 1, tmp_path)
        _, stderr = rank.communicate(timeout=60)
        assert "transform failed: ValueError: seven is not allowed" in stderr


@pytest.mark.parametrize("senders", [0, 2])
def test_wrong_token_and_garbage_clients_do_not_disturb_a_good_rank(corpus, tmp_path, senders):
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "workers": 3, "steps": 40, "senders": senders}
    reference = run_ranks(spec, world=1, out_dir=tmp_path)
    with omniload.Job(spec) as job:
        host, port = job.addr.rsplit(":", 1)
        garbage = socket.create_connection((host, int(port)))
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: omniload\r\n\r\n")
        silent = socket.create_connection((host, int(port)))  # says nothing at all
        with pytest.raises(omniload.OmniloadError, match="authentication failed"):
            next(omniload.connect(job.addr, "not-the-token", rank=0, world_size=1))
        good = collect(start_ranks(job, 1, tmp_path))
        assert garbage.recv(4096)[:2] == b"OL"  # an ERROR frame, then the connection is closed
        assert garbage.recv(4096) == b""
        garbage.close()
        silent.close()
    assert good[0]["hashes"] == reference[0]["hashes"]


@pytest.mark.parametrize("senders", [0, 2])
def test_rank_that_disconnects_resumes_after_its_last_consumed_step(corpus, tmp_path, senders):
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "workers": 3, "steps": 12, "senders": senders}
    with omniload.Job(spec) as job:
        with omniload.connect(job.addr, job.token, rank=0, world_size=1) as loader:
            reference = [batch["input_ids"].clone() for batch in loader]
    with omniload.Job(spec) as job:
        first = omniload.connect(job.addr, job.token, rank=0, world_size=1, prefetch=4)
        seen = [next(first)["input_ids"].clone() for _ in range(5)]
        first.close()  # with batches prefetched but never consumed
        second = omniload.connect(job.addr, job.token, rank=0, world_size=1)
        assert second.info["resume_step"] == 5
        seen += [batch["input_ids"].clone() for batch in second]
        second.close()
    assert len(reference) == len(seen) == 12
    assert all(torch.equal(a, b) for a, b in zip(reference, seen)), "nothing skipped, nothing repeated"
