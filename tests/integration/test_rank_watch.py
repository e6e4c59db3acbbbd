"""A rank that dies, hangs or runs ahead is named to the others; a normal end says nothing alarming."""

from __future__ import annotations

import signal
import time

import pytest

import omniload
from tests.corpus import mixed_sources
from tests.jobs import collect, start_ranks, wait_connected, wait_for_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
TIMEOUT_S = 3.0


def _spec(corpus) -> dict:
    return {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "rows": 2,
        "workers": 3,
        "epochs": 0,
        "plan_ahead": 4,
        "rank_timeout": TIMEOUT_S,
    }


def _wait_exit(process, seconds: float) -> str:
    _, stderr = process.communicate(timeout=seconds)
    return stderr


def test_a_killed_rank_is_named_to_the_others_within_the_rank_timeout(corpus, tmp_path):
    with omniload.Job(_spec(corpus)) as job:
        (rank0, _), (rank1, _) = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.02"})
        wait_for_status(job, lambda s: s["steps"]["slowest"] >= 2, "two steps consumed by both ranks")
        assert rank0.poll() is None and rank1.poll() is None, "both ranks consume"
        rank1.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        stderr = _wait_exit(rank0, 30)
        took = time.monotonic() - killed
        rank1.wait()
        assert job.wait(15) == 1
        log = "\n".join(job.log_tail())
    assert rank0.returncode != 0
    assert "rank 0 waits: rank 1 disconnected" in stderr, stderr[-3000:]  # told while it waited
    assert "stopping the job: rank 1 disconnected" in stderr and "without saying goodbye" in stderr
    assert f"--rank-timeout {TIMEOUT_S:.0f}s" in stderr
    assert took < TIMEOUT_S + 5, f"the error came {took:.1f}s after the kill"
    assert "rank 1 disconnected without saying goodbye" in log


def test_a_rank_that_runs_ahead_is_told_why_it_waits_and_the_stuck_rank_is_named(corpus, tmp_path):
    with omniload.Job(_spec(corpus)) as job:
        ((ahead, _),) = start_ranks(job, 1, tmp_path, env={"RANK": "0", "WORLD_SIZE": "2"})
        ((stuck, _),) = start_ranks(job, 1, tmp_path, env={"RANK": "1", "WORLD_SIZE": "2", "PROBE_HANG_AFTER": "2"})
        stderr = _wait_exit(ahead, 40)
        stuck.kill()
        stuck.wait()
        assert job.wait(15) == 1
    assert "rank 0 waits: rank 1 has not acknowledged a batch for" in stderr, stderr[-3000:]
    assert "rank(s) 0 are 4 steps ahead of it and wait: --plan-ahead 4" in stderr
    assert "draw the same number of batches on every rank" in stderr
    assert "stopping the job: rank 1 has not acknowledged a batch for 3s (it has consumed 2 steps)" in stderr


def test_a_trainer_that_stops_without_close_ends_quietly(corpus, tmp_path):
    spec = {**_spec(corpus), "epochs": 1, "steps": 30}
    with omniload.Job(spec) as job:
        ranks = collect(start_ranks(job, 2, tmp_path, max_steps=10, env={"PROBE_NO_CLOSE": "1"}))
        time.sleep(0.5)
        log = "\n".join(job.log_tail())
    assert [len(r["hashes"]) for r in ranks] == [10, 10]
    assert "disconnected" not in log, log


def test_a_rank_that_stops_in_the_last_steps_is_named_too(corpus, tmp_path):
    """Once the data has ended the planner waits for nobody, yet a rank that stopped short
    still holds the others in their last collective: it is named and timed out as before."""
    spec = {**_spec(corpus), "epochs": 1, "steps": 10, "plan_ahead": 8}
    with omniload.Job(spec) as job:
        ((done, _),) = start_ranks(job, 1, tmp_path, env={"RANK": "0", "WORLD_SIZE": "2", "PROBE_HANG_AFTER": "10"})
        ((short, _),) = start_ranks(job, 1, tmp_path, env={"RANK": "1", "WORLD_SIZE": "2", "PROBE_HANG_AFTER": "5"})
        assert job.wait(60) == 1
        log = "\n".join(job.log_tail())
        for rank in (done, short):
            rank.kill()
            rank.wait()
    assert "stopping the job: rank 1 has not acknowledged a batch for 3s (it has consumed 5 steps)" in log, log


def test_a_mix_after_the_data_ended_is_refused_and_the_job_goes_on(corpus, tmp_path):
    spec = {**_spec(corpus), "epochs": 1, "steps": 6, "plan_ahead": 8}
    with omniload.Job(spec) as job:
        loader = omniload.connect(job.addr, job.token, rank=0, world_size=1)
        next(loader)
        wait_for_status(job, lambda s: s["steps"]["final"] == 6, "end of the data seen by the planner")
        with pytest.raises(omniload.ConfigError, match="the data has ended after 6 steps"):
            job.set_weights({"web": 1.0})
        assert len([batch for batch in loader]) == 5
        loader.close()
        assert job.wait(15) == 0


def test_a_rank_that_joins_after_the_rank_timeout_is_waited_for_and_changes_no_batch(corpus, tmp_path):
    """A rank that has not connected yet (a late node, a slow import: 60 s happens) is named but
    never timed out: the job waits past --rank-timeout and every rank gets the batches of a job
    whose ranks came at once. (The others wait for it from their first batch on.)"""
    spec = {**_spec(corpus), "steps": 30}
    with omniload.Job(spec) as job:
        reference = collect(start_ranks(job, 2, tmp_path))
    with omniload.Job(spec) as job:
        first = start_ranks(job, 1, tmp_path, env={"RANK": "0", "WORLD_SIZE": "2"})
        wait_connected(job, 1)
        time.sleep(2 * TIMEOUT_S)  # past the rank timeout, rank 1 not there yet
        assert job.poll() is None, "\n".join(job.log_tail())
        late = start_ranks(job, 1, tmp_path, env={"RANK": "1", "WORLD_SIZE": "2"})
        results = collect(first + late)
    for rank in range(2):
        assert results[rank]["hashes"] == reference[rank]["hashes"], f"rank {rank} saw other batches"
