"""Sender processes (`--senders N`): a dead sender named, a rank that hangs up at once.
That senders change no byte is checked with relays in test_relay.py."""

from __future__ import annotations

import signal
import time

import pytest

import omniload
from tests.corpus import mixed_sources
from tests.jobs import collect, senders_of, start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _spec(corpus: dict[str, str], senders: int) -> dict:
    return {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "rows": 2,
        "workers": 2,
        "seed": 5,
        "steps": 40,
        "senders": senders,
    }


def test_a_killed_sender_stops_the_job_with_an_error_naming_it(corpus, tmp_path):
    spec = {**_spec(corpus, 2), "steps": 0, "epochs": 0}
    with omniload.Job(spec) as job:
        ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.02"})
        senders = senders_of(job)
        deadline = time.monotonic() + 60
        while not all(s.net_connections("tcp") for s in senders):
            assert time.monotonic() < deadline, "the ranks never reached the senders"
            time.sleep(0.05)
        victim = senders[0]
        victim.send_signal(signal.SIGKILL)
        assert job.wait(30) == 1
        log = "\n".join(job.log_tail())
        errors = [process.communicate(timeout=30)[1] for process, _ in ranks]
    assert f"sender 0 (pid {victim.pid}) was killed by SIGKILL" in log, log
    assert all(process.returncode != 0 for process, _ in ranks)
    assert any("sender 0" in error for error in errors), "the rank the other sender serves is told why"


def test_a_rank_that_hangs_up_right_after_hello_can_connect_again(corpus, tmp_path):
    import socket

    from omniload.protocol import Kind, Message, encode

    with omniload.Job(_spec(corpus, 2)) as job:
        host, port = job.addr.rsplit(":", 1)
        for _ in range(3):
            with socket.create_connection((host, int(port))) as quitter:
                quitter.sendall(encode(Message(Kind.HELLO, {"token": job.token, "rank": 0, "world_size": 1})))
        deadline = time.monotonic() + 30
        while True:  # until the coordinator has seen the last quitter go: never a session left behind
            try:
                with omniload.connect(job.addr, job.token, rank=0, world_size=1) as loader:
                    steps = [loader.step for _ in loader]
                break
            except omniload.OmniloadError as exc:
                assert "already connected" in str(exc) and time.monotonic() < deadline, exc
                time.sleep(0.1)
    assert steps == list(range(40))


def test_auto_senders_keep_none_for_a_small_world_and_change_no_byte(corpus, tmp_path, monkeypatch):
    """--senders -1 starts one sender per 8 cores before it knows the world; two ranks need
    none, so both exit at the first HELLO (no memory held for nothing) and the coordinator
    serves the ranks itself, with the bytes of --senders 0."""
    with omniload.Job(_spec(corpus, 0)) as job:
        direct = collect(start_ranks(job, 2, tmp_path))
    monkeypatch.setenv("OMNILOAD_CPUS", "16")  # the job's coordinator sizes its senders for 16 cores
    monkeypatch.setenv("OMNILOAD_LOG", "info")
    with omniload.Job(_spec(corpus, -1)) as job:
        started = senders_of(job)
        ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.1"})
        for sender in started:  # (not our child: psutil cannot say its exit code; the log would)
            sender.wait(30)
        deadline = time.monotonic() + 30
        while True:  # both ranks connected: what carries them is then known
            seen = job.status()["ranks"]
            if len(seen) == 2 and all(rank["connection"] == "connected" for rank in seen):
                break
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        served = collect(ranks)
        deadline = time.monotonic() + 10  # the log reaches us on a thread
        while "senders serve" not in (log := "\n".join(job.log_tail())) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert len(started) == 2, "16 cores start 2 senders"
    assert "0 of 2 senders serve this job's ranks" in log, log
    assert "exited with code" not in log, "the senders the world does not need exit cleanly"
    assert [rank["via"] for rank in seen] == ["", ""], "the coordinator serves both ranks itself"
    assert [r["hashes"] for r in served] == [r["hashes"] for r in direct]
