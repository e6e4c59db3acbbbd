"""Progress bookkeeping (pure): the slowest rank in O(1) per ACK, and who holds the job back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omniload.coordinator.plan.progress import Progress, find_stall


@given(st.integers(1, 12), st.lists(st.tuples(st.integers(0, 11), st.integers(0, 3)), max_size=200))
def test_slowest_is_always_the_minimum_and_moves_by_what_it_reports(world, moves):
    progress = Progress(range(world), start=5)
    for rank, forward in moves:
        rank %= world
        slowest = min(progress.consumed.values())
        moved = progress.move(rank, progress.consumed[rank] + forward)
        assert progress.slowest == min(progress.consumed.values())
        assert moved == progress.slowest - slowest
        assert rank in progress.ranks_at(progress.consumed[rank])


def test_a_rank_may_go_back_but_never_below_the_slowest():
    progress = Progress([0, 1], start=0)
    progress.move(0, 6)
    progress.move(1, 3)
    progress.move(0, 4)  # a reconnecting rank resumes from a position it kept
    assert progress.consumed == {0: 4, 1: 3} and progress.slowest == 3
    with pytest.raises(ValueError, match="every rank has consumed 3"):
        progress.move(0, 2)


def _held(silent: float = 20.0, connection: str = "connected"):
    """Rank 1 is at step 2; ranks 0 and 2 consumed all 6 planned steps (plan-ahead 4)."""
    progress = Progress([0, 1, 2], start=0)
    progress.move(0, 6)
    progress.move(1, 2)
    progress.move(2, 6)
    heard = {0: 99.0, 1: 100.0 - silent, 2: 99.0}
    return find_stall(
        progress,
        planned=6,
        plan_ahead=4,
        heard=heard,
        connection={0: "connected", 1: connection, 2: "connected"},
        now=100.0,
    )


def test_the_rank_holding_the_others_is_named_with_how_long_it_is_silent():
    stall = _held(silent=20.0)
    assert (stall.rank, stall.consumed, stall.silent_s, stall.waiting, stall.ahead) == (1, 2, 20.0, (0, 2), 4)
    message = stall.describe(plan_ahead=4, timeout_s=600)
    assert "rank 1 has not acknowledged a batch for 20s" in message
    assert "rank(s) 0, 2 are 4 steps ahead" in message and "--plan-ahead 4" in message
    assert "draw the same number of batches on every rank" in message and "--rank-timeout 600s" in message


@pytest.mark.parametrize(
    "connection, says",
    [
        ("gone", "disconnected 20s ago without saying goodbye"),
        ("never", "has not connected for 20s"),
        ("said bye", "closed its loader 20s ago"),
    ],
)
def test_a_missing_rank_is_named_for_what_happened_to_it(connection, says):
    assert says in _held(connection=connection).describe(plan_ahead=4, timeout_s=0)


def test_no_stall_while_the_planner_may_go_on_or_nobody_has_run_dry():
    progress = Progress([0, 1], start=0)
    progress.move(0, 3)
    heard, connection = {0: 0.0, 1: 0.0}, {0: "connected", 1: "connected"}
    # the planner is 3 ahead of the slowest and may plan 4: a slow source, not a rank, is waited for
    assert find_stall(progress, planned=3, plan_ahead=4, heard=heard, connection=connection, now=50.0) is None
    # held by plan-ahead, but rank 0 still has a planned step to consume: nobody waits yet
    assert find_stall(progress, planned=4, plan_ahead=4, heard=heard, connection=connection, now=50.0) is None
    progress.move(0, 4)
    assert find_stall(progress, planned=4, plan_ahead=4, heard=heard, connection=connection, now=50.0).rank == 1


def test_after_the_data_ended_the_ranks_at_the_end_wait_for_the_one_that_stopped_short():
    progress = Progress([0, 1], start=0)
    progress.move(0, 10)
    progress.move(1, 5)
    heard, now = {0: 99.0, 1: 90.0}, 100.0
    connected = {0: "connected", 1: "connected"}
    assert find_stall(progress, 10, 8, heard, connected, now) is None  # 5 behind, plan-ahead 8: planning goes on
    stall = find_stall(progress, 10, 8, heard, connected, now, ended=True)
    assert (stall.rank, stall.consumed, stall.waiting) == (1, 5, (0,))
    assert "--plan-ahead" not in stall.describe(8, 600)  # not plan-ahead's doing: the data ended
    # a rank that has everything and hung up waits for nobody
    assert find_stall(progress, 10, 8, heard, {0: "said bye", 1: "connected"}, now, ended=True) is None
