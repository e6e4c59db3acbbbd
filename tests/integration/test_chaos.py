"""Chaos, short versions (the long ones are scripts/chaos_*.py): fuzzed connections, workers
killed at random, a checkpoint disk that fills up. The coordinator never crashes or hangs, good
ranks see exactly the batches of an undisturbed run, and nothing is left behind."""

from __future__ import annotations

import os
import random
import signal
import socket
import time

import psutil
import pytest

import omniload
from omniload.coordinator.checkpoint.folder import last_position
from omniload.protocol import PREFIX, VERSION, Kind, Message, encode
from tests.corpus import mixed_sources
from tests.jobs import (
    ROOT,
    collect,
    coordinator_on_a_small_disk,
    run_ranks,
    start_ranks,
    wait_connected,
    why_no_private_tmpfs,
    workers_of,
)
from tests.rank_forkserver import spawn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def assert_port_closed(addr: str) -> None:
    host, port = addr.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()


def _fuzz_frames(token: str, rng: random.Random) -> list[tuple[str, bytes]]:
    hello = encode(Message(Kind.HELLO, {"token": token, "rank": 0, "world_size": 3, "credits": 2}))
    return [
        ("random bytes", rng.randbytes(rng.randint(1, 4096))),
        ("a truncated HELLO", hello[: rng.randint(1, len(hello) - 1)]),
        ("a huge header length", PREFIX.pack(b"OL", VERSION, Kind.HELLO, 1 << 31, 0)),
        ("a huge payload length", PREFIX.pack(b"OL", VERSION, Kind.HELLO, 2, 1 << 60) + b"{}"),
        ("a wrong token", encode(Message(Kind.HELLO, {"token": "nope", "rank": 2, "world_size": 3}))),
        ("a wrong version", PREFIX.pack(b"OL", VERSION + 7, Kind.HELLO, 2, 0) + b"{}"),
        ("a HELLO with a string rank", encode(Message(Kind.HELLO, {"token": token, "rank": "2", "world_size": 3}))),
        ("a duplicate HELLO for served rank 0", hello),
        ("an ACK before HELLO", encode(Message(Kind.ACK, {"step": 3}))),
    ]


def _fuzz(addr: str, token: str, rounds: int, answers: list[tuple[str, bytes]]) -> None:
    host, port = addr.rsplit(":", 1)
    rng = random.Random(7)
    for _ in range(rounds):
        for what, data in _fuzz_frames(token, rng):
            with socket.create_connection((host, int(port)), timeout=15) as sock:
                sock.sendall(data)
                if what.startswith("a truncated"):
                    sock.shutdown(socket.SHUT_WR)
                answers.append((what, sock.recv(65536)))


def test_fuzzed_connections_leave_the_coordinator_and_good_ranks_untouched(corpus, tmp_path):
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "workers": 3, "steps": 60}
    reference = run_ranks(spec, world=3, out_dir=tmp_path)
    with omniload.Job(spec) as job:
        host, port = job.addr.rsplit(":", 1)
        coordinator = psutil.Process(job._process.pid)
        idle = [socket.create_connection((host, int(port))) for _ in range(500)]  # they never say a word
        good = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.02", "WORLD_SIZE": "3"})
        wait_connected(job, 502)
        memory_before = coordinator.memory_info().rss
        answers: list[tuple[str, bytes]] = []
        _fuzz(job.addr, job.token, rounds=5, answers=answers)
        # rank 2 misbehaves first: it acknowledges a step it was never sent, and is dropped
        liar = omniload.connect(job.addr, job.token, rank=2, world_size=3)
        liar.info  # noqa: B018  (connects)
        liar._sock.sendall(encode(Message(Kind.ACK, {"step": 10_000})))
        with pytest.raises(omniload.OmniloadError, match="acknowledged step 10000, but it was sent"):
            for _ in liar:
                pass
        liar.close()
        results = collect(good + start_ranks(job, 1, tmp_path, env={"RANK": "2", "WORLD_SIZE": "3"}))
        memory_growth = coordinator.memory_info().rss - memory_before
        for sock in idle:  # the handshake timeout closed them; nothing else happened to them
            sock.settimeout(15)
            assert sock.recv(65536)[:2] in (b"OL", b"")
            sock.close()
        assert job.wait(30) == 0, "\n".join(job.log_tail())
    assert [r["hashes"] for r in results] == [r["hashes"] for r in reference], "good ranks saw other batches"
    for what, answer in answers:
        assert answer[:2] == b"OL" or answer == b"", f"{what}: {answer[:80]!r}"  # an ERROR frame, or closed
    refusals = {what: answer for what, answer in answers if answer}
    assert b"already connected" in refusals["a duplicate HELLO for served rank 0"]
    assert b"authentication failed" in refusals["a wrong token"]
    assert b"version 9" in refusals["a wrong version"]
    assert memory_growth < 64 << 20, f"the coordinator grew by {memory_growth >> 20} MB"
    assert_port_closed(job.addr)


def test_workers_killed_at_random_change_no_batch_and_stall_no_rank(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    spec = {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "rows": 2,
        "workers": 3,
        "seed": 9,
        "epochs": 0,
        "steps": 150,
        "max_restarts": 100,
        "tokenizer": "tests.transforms_for_tests:slow_bytes",
        "ring_mb": 1,
    }
    reference = run_ranks(spec, world=2, out_dir=tmp_path)
    kills = 10
    with omniload.Job(spec) as job:
        ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.03"})
        wait_connected(job, 2)
        rng = random.Random(3)
        for _ in range(kills):
            time.sleep(rng.uniform(0.1, 0.4))
            while not (alive := [w for w in workers_of(job) if w.status() != psutil.STATUS_ZOMBIE]):
                time.sleep(0.01)  # a replacement is starting
            victim = rng.choice(alive)
            victim.send_signal(signal.SIGKILL)
            psutil.wait_procs([victim], timeout=5)
        results = collect(ranks)
        log = "\n".join(job.log_tail())
    assert log.count("was killed by SIGKILL; restarting it at the source cursor") == kills, log
    for rank in range(2):
        assert results[rank]["hashes"] == reference[rank]["hashes"], f"rank {rank} saw other batches"
    # a stall is a wait for something that never comes (a lost record, a worker never replaced:
    # the worker timeout, 300 s); a replacement's start on a busy 2-core machine takes seconds
    worst = max(max(r["waits"]) for r in results)
    assert worst < 10.0, f"a rank waited {worst:.2f}s for a batch"
    assert_port_closed(job.addr)


_JUMPING_CLOCK = """
import os, time
_real, _start = time.time, time.monotonic()
def _jumping():  # +1 hour after 1 s, then 1 hour before the true time after 2 s
    since = time.monotonic() - _start
    return _real() + (3600.0 if 1.0 <= since < 2.0 else -3600.0 if since >= 2.0 else 0.0)
time.time = _jumping
open(MARK + str(os.getpid()), "w").close()  # this process runs on the jumping clock
"""


def test_a_clock_jump_changes_no_batch_and_times_nothing_out(corpus, tmp_path, monkeypatch):
    """The wall clock jumps an hour ahead, then an hour behind, in the coordinator, its forkserver
    and its workers (their time.time): every wait is timed with the monotonic clock, so with
    timeouts of 5 s nothing times out, and the batches are those of an undisturbed run."""
    spec = {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "rows": 2,
        "workers": 2,
        "seed": 4,
        "epochs": 0,
        "steps": 100,
        "worker_timeout": 5,
        "rank_timeout": 5,
    }
    reference = run_ranks(spec, world=2, out_dir=tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"MARK = {str(tmp_path / 'jumped-')!r}\n" + _JUMPING_CLOCK)
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with omniload.Job(spec) as job:
        results = collect(start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.04"}))  # ~4 s
        coordinator = job._process.pid
    jumped = {int(p.name.rsplit("-", 1)[1]) for p in tmp_path.glob("jumped-*")}
    assert coordinator in jumped and len(jumped) >= 3, jumped  # the coordinator, its forkserver, a worker
    for rank in range(2):
        assert results[rank]["hashes"] == reference[rank]["hashes"], f"rank {rank} saw other batches"


def test_a_full_checkpoint_disk_stops_the_job_naming_the_folder_and_leaves_a_loadable_one(corpus, tmp_path):
    why = why_no_private_tmpfs()
    if why:
        pytest.skip(why)
    spec = {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "rows": 2,
        "workers": 3,
        "seed": 4,
        "epochs": 0,
        "steps": 200,
    }
    reference = run_ranks(spec, world=2, out_dir=tmp_path)
    folder, kept = tmp_path / "small-disk", tmp_path / "what-it-held"
    folder.mkdir()
    kept.mkdir()
    token = "chaos-token"
    coordinator, addr = coordinator_on_a_small_disk(
        {**spec, "checkpoint_dir": str(folder), "snapshot_every": 3}, folder, kept, "16k", token
    )
    env = {"OMNILOAD_ADDR": addr, "OMNILOAD_TOKEN": token}
    ranks = [
        spawn([str(tmp_path / f"r{r}.json")], env={**os.environ, **env, "RANK": str(r), "WORLD_SIZE": "2"})
        for r in range(2)
    ]
    errors = [rank.communicate(timeout=60)[1] for rank in ranks]
    _, log = coordinator.communicate(timeout=30)
    log = log.decode()
    assert coordinator.returncode == 1, log
    for rank, error in zip(ranks, errors):
        assert rank.returncode != 0
        assert f"checkpoint folder {folder}: [Errno 28] No space left on device" in error, error[-2000:]
        assert "choose another --checkpoint-dir" in error
    assert "No space left on device" in log
    assert not list(kept.glob("*.tmp")), "a partial snapshot was left"
    found = last_position(kept)
    assert found is not None and found.step > 0
    with omniload.Job({**spec, "resume": str(kept)}) as job:
        resumed = collect(start_ranks(job, 2, tmp_path))
    for rank in range(2):
        assert resumed[rank]["hashes"] == reference[rank]["hashes"][found.step :], f"rank {rank} resumed elsewhere"
    assert_port_closed(addr)
    assert_port_closed(job.addr)
