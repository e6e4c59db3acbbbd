"""The lease rules (coordinator/ha/lease.py): when a standby takes over, when a primary fences itself."""

from __future__ import annotations

import os
import socket

from omniload.coordinator.ha import lease as leases
from omniload.coordinator.ha.lease import ENDED, FOLLOW, TAKE_OVER, WAIT, Lease, Watch, judge, must_fence

_JOB = "j0b"


def _lease(epoch: int = 1, stamp: int = 100, job: str = _JOB) -> Lease:
    return Lease(epoch, pid=42, host="h", addr="h:1", job=job, stamp=stamp)


def _judge(watch, lease, now, alive=None, ended=None):
    return judge(watch, lease, now, job=_JOB, holder_alive=alive, ended=ended, lease_s=3.0)


def test_a_standby_waits_for_a_lease_of_its_own_job():
    assert _judge(None, None, 0.0) == (WAIT, None)
    assert _judge(None, _lease(job="another"), 0.0) == (WAIT, None)


def test_a_renewed_lease_is_followed_and_an_unrenewed_one_taken_over_after_lease_s():
    decision, watch = _judge(None, _lease(stamp=1), 10.0)
    assert decision == FOLLOW and watch == Watch(1, 1, 10.0)
    assert _judge(watch, _lease(stamp=1), 12.9) == (FOLLOW, watch)
    decision, renewed = _judge(watch, _lease(stamp=2), 12.9)
    assert decision == FOLLOW and renewed == Watch(1, 2, 12.9)  # a renewal restarts the count
    assert _judge(renewed, _lease(stamp=2), 15.9)[0] == TAKE_OVER


def test_a_new_epoch_is_followed_afresh():
    _, watch = _judge(None, _lease(epoch=1, stamp=5), 0.0)
    decision, again = _judge(watch, _lease(epoch=2, stamp=5), 100.0)
    assert decision == FOLLOW and again == Watch(2, 5, 100.0)


def test_a_dead_holder_on_this_host_is_taken_over_at_once_and_an_ended_job_is_left():
    _, watch = _judge(None, _lease(), 0.0)
    assert _judge(watch, _lease(), 0.1, alive=False)[0] == TAKE_OVER
    assert _judge(watch, _lease(), 0.1, alive=False, ended=0)[0] == ENDED
    assert _judge(watch, _lease(), 99.0, ended=1)[0] == ENDED


def test_the_primary_fences_itself_before_any_standby_may_take_over():
    assert must_fence(1, 1, renewed_at=10.0, now=11.0) is None
    assert "epoch 2" in must_fence(1, 2, renewed_at=10.0, now=10.1)
    assert "could not renew" in must_fence(1, 1, renewed_at=10.0, now=10.0 + leases.FENCE_S + 0.01)
    assert leases.FENCE_S + 2 * leases.RENEW_S < leases.LEASE_S  # the margin the two rules rely on


def test_only_one_coordinator_acquires_an_epoch(tmp_path):
    assert leases.highest_epoch(tmp_path) == 0 and leases.read_lease(tmp_path) is None
    assert leases.acquire(tmp_path, 1, "a:1", _JOB)
    assert not leases.acquire(tmp_path, 1, "b:2", _JOB)
    held = leases.read_lease(tmp_path)
    assert (held.epoch, held.pid, held.addr, held.host) == (1, os.getpid(), "a:1", socket.gethostname())
    assert leases.holder_alive(held) is True
    assert leases.ended_code(tmp_path, 1) is None
    leases.mark_ended(tmp_path, 1, 0)
    assert leases.ended_code(tmp_path, 1) == 0


def test_a_new_epoch_forgets_the_older_ones(tmp_path):
    for epoch in (1, 2, 3):
        assert leases.acquire(tmp_path, epoch, "a:1", _JOB)
    leases.mark_ended(tmp_path, 1, 0)
    leases.remove_older(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lease-0000000003.json"]
