"""Shared fixtures. Every test ends with the check of docs/architecture.md's invariant "Nothing
left behind": no shared-memory segment of ours and no child process of the test left behind."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import psutil
import pytest

from omniload.formats.ring import PREFIX, SHM_DIR
from tests import rank_forkserver

_GRACE_S = 10.0
# Every process this test session starts inherits the marker, so the leak check finds this
# session's orphans and never a process of a run beside it (a benchmark, another suite).
_MARKER = "OMNILOAD_TEST_SESSION"
os.environ[_MARKER] = uuid.uuid4().hex
# The suite's processes share the CPUs: torch's intra-op pool in each rank would spin on cores
# another test needs (a test that wants threads, bench_quality's, asks for them).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Python's default, which this machine's environment turns off: the coordinators, forkservers and
# CLIs the tests start (hundreds) read omniload's compiled modules instead of compiling them
# each time, 0.18 of 0.6 CPU-seconds an import of the coordinator's and workers' modules.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
_SESSION_PROCESSES: set[int] = set()  # helpers that live for the session (the S3 endpoint), never leaks
# Under pytest-xdist the test processes share /dev/shm, and a segment whose owner died may be
# another process's test at work (a coordinator it killed on purpose, its segments removed
# moments later). So there each test checks the segments of its own live coordinators, and the
# run's end checks that no dead owner's segment is left (pytest_sessionfinish, below).
_PARALLEL = "PYTEST_XDIST_WORKER" in os.environ


def _our_segments(dead_owners: bool = not _PARALLEL) -> list[str]:
    """Segments of this session's coordinators, and with `dead_owners` those of dead ones (a
    leak is often a dead owner); never those of a live coordinator of a run beside this one."""
    found = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        try:
            owner = psutil.Process(int(pid))
        except (ValueError, psutil.NoSuchProcess):
            if dead_owners:
                found.append(path.name)
            continue
        if _ours(owner):
            found.append(path.name)
    return sorted(found)


def _dead_owners_segments() -> list[str]:
    return sorted(set(_our_segments(dead_owners=True)) - set(_our_segments(dead_owners=False)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The whole run's check: no segment of a dead coordinator left in /dev/shm (in a parallel
    run, once every test process is done: here, in the one that started them)."""
    if _PARALLEL:
        return
    deadline = time.monotonic() + _GRACE_S
    while (left := _dead_owners_segments()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        session.config.get_terminal_writer().line(f"\nshared-memory segments of dead coordinators left behind: {left}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _orphans(since: float) -> list[psutil.Process]:
    """Processes of this session started since `since` that were reparented away from the
    test (a coordinator, forkserver or worker whose parent died): children() cannot see them."""
    found = []
    for process in psutil.process_iter(["create_time", "status"]):
        info = process.info
        if (
            (info["create_time"] or 0) >= since
            and info["status"] != psutil.STATUS_ZOMBIE
            and process.pid != os.getpid()
            and _ours(process)
        ):
            found.append(process)
    return found


def _cmdline(process: psutil.Process) -> list[str] | str:
    try:
        return process.cmdline()
    except psutil.Error as exc:  # it ended (or is a zombie) since it was found
        return type(exc).__name__


def _ours(process: psutil.Process) -> bool:
    try:
        return process.environ().get(_MARKER) == os.environ[_MARKER]
    except (psutil.Error, OSError):
        return False


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a test process for each CPU this run may use, and one more (xdist's own count
    would take the physical cores, 1 on a 2-vCPU CI machine). The integration tests spend part
    of their time waiting (a launch, a timeout, a slow rank), and the extra process fills it:
    on 2 cores the suite took 627 s with 2 and 531 s with 3. The tests are independent: each has
    its own session marker (above), S3 endpoint, rank forkserver and tmp_path."""
    return len(os.sched_getaffinity(0)) + 1


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = set(_our_segments())
    started = time.time() - 0.5
    yield
    me = psutil.Process()
    deadline = time.monotonic() + _GRACE_S
    while time.monotonic() < deadline:
        server = rank_forkserver.server_pid()  # lives for the session; its children are ranks, checked
        keep = {server, *_SESSION_PROCESSES}
        children = [
            c
            for c in me.children(recursive=True)
            if c.pid not in keep and c.is_running() and c.status() != psutil.STATUS_ZOMBIE
        ]
        children += [p for p in _orphans(started) if p not in children and p.pid not in keep]
        leftover = set(_our_segments()) - before
        if not children and not leftover:
            return
        time.sleep(0.1)
    for child in children:  # do not let one leak cascade into the next test
        child.kill()
    assert not children, f"processes left behind: {[(c.pid, _cmdline(c)) for c in children]}"
    assert not leftover, f"shared-memory segments left behind: {sorted(leftover)}"


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 endpoint on loopback (moto's server mode) for the whole session."""
    from tests.s3_store import MotoServer

    server = MotoServer()
    _SESSION_PROCESSES.add(server.process.pid)
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The S3 endpoint, emptied, with the standard AWS variables pointing at it for this test."""
    from tests.s3_store import store_env

    s3_server.reset()
    for name, value in store_env(s3_server.endpoint).items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def corpus(tmp_path: Path):
    from tests.corpus import make_mixed_corpus

    return make_mixed_corpus(tmp_path)
