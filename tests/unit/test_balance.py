import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from omniload.coordinator.plan.balance import assign
from omniload.coordinator.plan.cost import cost_function
from omniload.coordinator.plan.packer import Segment
from omniload.coordinator.plan.step_plan import plan_step

attention = cost_function("attention", (1.0, 100.0, 0.0), ["a"])


def _check_capacity(lengths, a, dp, rows, seq_len):
    used = np.zeros((dp, rows), dtype=np.int64)
    for length, rank, row in zip(lengths, a.rank, a.row):
        if rank >= 0:
            used[rank, row] += length
    assert (used <= seq_len).all()
    return used


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 256), max_size=120), st.integers(1, 8), st.integers(1, 4), st.integers(0, 10))
def test_capacity_holds_and_every_segment_is_placed_once_or_carried(lengths, dp, rows, carried):
    lengths = np.array(lengths, dtype=np.int64)
    costs = attention(lengths, np.zeros_like(lengths), np.zeros_like(lengths))
    a = assign(lengths, costs, min(carried, len(lengths)), dp, rows, 256)
    _check_capacity(lengths, a, dp, rows, 256)
    assert ((a.rank >= 0) == (a.row >= 0)).all()
    assert np.allclose(a.cost, [costs[a.rank == r].sum() for r in range(dp)])
    if lengths.sum() <= 256:  # one row holds them all, so none may be left out
        assert (a.rank >= 0).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 2048), min_size=16, max_size=200), st.integers(2, 8))
@example([1165, 1, 1, 1, 1, 1, 5, 433, 437, 437, 1, 1, 1, 726, 1, 886], 2)  # greedy 0.003% over round robin
def test_balance_beats_round_robin_and_nears_the_bound(lengths, dp):
    lengths = np.array(lengths, dtype=np.int64)
    seq_len, rows = 2048, int(np.ceil(lengths.sum() / 2048 / dp)) + 2  # room to spare: balance is the question
    costs = attention(lengths, np.zeros_like(lengths), np.zeros_like(lengths))
    a = assign(lengths, costs, 0, dp, rows, seq_len)
    assert (a.rank >= 0).all()
    figures = a.balance(costs)
    naive = max(costs[r::dp].sum() for r in range(dp))
    # greedy can lose to round robin by a hair where a few long segments decide (the example
    # above: 1,939,183 against 1,939,134, also at fdab950); it must never lose more
    assert figures["max_cost"] <= naive * (1 + 1e-3)
    # Graham's bound for greedy list scheduling: the busiest rank is at most the mean plus one
    # segment (LPT's 4/3 is against the optimum, which the lower bound may sit below: hypothesis
    # found a case at 1.335 of the bound)
    assert figures["max_cost"] <= figures["mean_cost"] + costs.max() + 1e-6
    assert figures["to_bound"] <= 1.5


def test_carried_segments_go_first():
    lengths = np.array([40, 64, 64])
    a = assign(lengths, lengths.astype(float), carried=1, dp=1, rows=2, seq_len=64)
    assert a.rank[0] == 0 and (a.rank[1:] == -1).sum() == 1


def test_groups_take_whole_rows_of_one_rank_or_wait_together():
    lengths = np.array([64, 64, 30, 10, 10])
    groups = [np.array([0, 1])]
    a = assign(lengths, lengths.astype(float), 0, dp=2, rows=2, seq_len=64, groups=groups)
    assert a.rank[0] == a.rank[1] >= 0 and sorted(a.row[:2]) == [0, 1]
    assert (a.rank[2:] != a.rank[0]).all()  # the group's rows are its own
    crowded = assign(np.array([64, 64, 64]), np.ones(3), 0, dp=2, rows=1, seq_len=64, groups=[np.array([0, 1])])
    assert (crowded.rank[:2] == -1).all() and crowded.rank[2] >= 0


def test_window_lets_an_outlier_wait_instead_of_overloading_a_rank():
    # eight carried segments load both ranks to 40 first; the fresh outlier (cost 50) would then
    # take one rank to 90, above the bound max(130 / 2, 50) = 65 (refinement brings it to 70)
    lengths = np.array([100] * 9)
    costs = np.array([10.0] * 8 + [50.0])
    eager = assign(lengths, costs, 8, dp=2, rows=8, seq_len=100)
    patient = assign(lengths, costs, 8, dp=2, rows=8, seq_len=100, may_wait=np.array([False] * 8 + [True]))
    assert eager.rank[8] >= 0 and eager.cost.max() == 70
    assert patient.rank[8] == -1, "the outlier waits for a later step"
    assert (patient.rank[:8] >= 0).all() and patient.cost.max() == 40


def _segments(lengths, delay=0):
    return [Segment(0, i, n, np.ones(n, np.int32), delay=delay) for i, n in enumerate(lengths)]


def test_plan_counts_the_delay_of_what_it_carries():
    plan = plan_step(_segments([30], delay=2), _segments([64, 64]), dp=1, rows=1, seq_len=64, cost_fn=attention)
    assert [s.length for s in plan.rows[0][0]] == [30]  # the carried segment went first
    assert [(s.length, s.delay) for s in plan.carry] == [(64, 1), (64, 1)]
    assert plan.balance["carried"] == 2 and plan.balance["max_delay"] == 2


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 64), max_size=60),
    st.integers(1, 40),
    st.integers(1, 5),
    st.floats(0.1, 1.5),
    st.booleans(),
    st.integers(0, 63),
    st.booleans(),
)
def test_the_python_pass_places_segments_as_the_vectorized_rounds_do(lengths, dp, rows, limit_share, waits, used, ties):
    """Up to _PYTHON_DP ranks, assign's greedy pass runs as plain Python (the rounds' numpy calls were a fifth
    of a 2-rank coordinator's CPU); the batches must stay what the rounds make, with segments
    that wait, rows already used, equal costs and segments that fit nowhere."""
    from omniload.coordinator.plan import balance

    lengths = np.array(lengths, dtype=np.int64)
    costs = (lengths // 8 * 8 if ties else lengths).astype(float) ** 2 + 3 * lengths
    order = np.argsort(-costs, kind="stable")
    may_wait = (lengths % 2 == 0) if waits else None
    limit = limit_share * float(costs.sum()) / dp
    results = []
    for greedy in (balance._greedy_python, balance._greedy_rounds):
        rank_of, row_of = np.full(len(lengths), -1), np.full(len(lengths), -1)
        free, rank_cost = np.full((dp, rows), 64, dtype=np.int64), np.zeros(dp)
        free[0, 0] -= used
        rank_cost[0] = used
        greedy(order, lengths, costs, rank_of, row_of, free, rank_cost, limit, may_wait)
        results.append((rank_of.tolist(), row_of.tolist(), free.tolist(), rank_cost.tolist()))
    assert results[0] == results[1]
