"""The autoscaler's pure parts: budget, lanes, packing by cost, hysteresis, starvation."""

from __future__ import annotations

from omniload.coordinator.pool.autoscale import (
    MARGIN,
    STARVED_BOOST,
    TAKEN_MEMORY,
    Moves,
    Window,
    auto_budget,
    auto_lanes,
    busiest,
    demands,
    grow,
    idle,
    initial_plan,
    keep_in_place,
    moves,
    pack,
    resplit,
    running,
    saturated,
    shrink,
    update_costs,
    update_taken,
    workers_per_source,
)


def _lanes_of(plan):
    return sorted(key for worker in plan for key in worker)


def test_budget_leaves_the_reserve_and_keeps_one_worker():
    assert auto_budget(16, 2) == 14
    assert auto_budget(2, 1) == 1
    assert auto_budget(1, 4) == 1


def test_auto_lanes_give_room_to_spread_without_a_ring_per_worker_per_source():
    assert auto_lanes(4, 2) == [2, 2, 2, 2]  # any source can use both workers
    assert auto_lanes(16, 2) == [1] * 16  # more sources than 4 lanes per worker: one each
    assert auto_lanes(4, 16) == [4, 4, 4, 4]  # capped
    assert auto_lanes(3, 1) == [1, 1, 1]


def test_pack_serves_every_lane_once_within_the_budget():
    lanes = [2, 2, 1]
    plan = pack(lanes, [1.0, 5.0, 0.5], 3)
    assert len(plan) == 3
    assert _lanes_of(plan) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]


def test_a_costly_source_spreads_over_the_workers_and_cheap_ones_share():
    # one source 10x per token, three cheap ones: 2 workers, 2 lanes each
    lanes = [2, 2, 2, 2]
    plan = pack(lanes, [10.0, 1.0, 1.0, 1.0], 2)
    assert workers_per_source(plan, 4)[0] == 2  # the costly one on both workers
    loads = sorted(sum(d / 2 for s, _ in w for d in [[10.0, 1.0, 1.0, 1.0][s]]) for w in plan)
    assert loads[-1] - loads[0] <= 1.0  # balanced to within one cheap lane


def test_static_split_by_weight_is_what_explicit_workers_get():
    plan = initial_plan([1.0, 1.0, 1.0, 1.0], 4, reserve=1, cpus=64)
    assert plan == [[(0, 0)], [(1, 0)], [(2, 0)], [(3, 0)]]


def test_auto_starts_one_worker_with_every_lane_and_a_slot_for_each_cpu_of_the_budget():
    plan = initial_plan([1.0, 1.0, 1.0, 1.0], 0, reserve=1, cpus=3)
    assert len(plan) == 2 and running(plan) == 1 and plan[1] == []
    assert _lanes_of(plan) == [(s, j) for s in range(4) for j in range(2)]  # the budget's lanes, from the start
    static = initial_plan([1.0, 1.0, 1.0, 1.0], 0, reserve=1, cpus=3, grows=False)  # --autoscale-every 0
    assert running(static) == 2 and _lanes_of(static) == _lanes_of(plan)


def test_the_pool_doubles_its_running_workers_up_to_the_budget_and_keeps_the_lanes():
    weights = [1.0] * 16
    plan = initial_plan(weights, 0, reserve=1, cpus=16)  # 15 slots, 4 lanes a source
    sizes = [running(plan)]
    while (bigger := grow(plan, [4] * 16, weights)) is not None:
        assert _lanes_of(bigger) == _lanes_of(plan) and len(bigger) == 15
        # every running worker keeps some of its lanes (none is left idle); new slots take lanes
        assert all(set(old) & set(new) for old, new in zip(plan, bigger) if old)
        plan = bigger
        sizes.append(running(plan))
    assert sizes == [1, 2, 4, 8, 15]


def test_the_pool_grows_only_while_its_running_workers_are_busy():
    window = [Window(cpu_s=0.2, produced=10**6, taken=10**6, starved=True, busy_s=1.7)]
    assert saturated(window, workers=2, seconds=1.0)  # 85% of two workers' time producing (waits count)
    assert not saturated(window, workers=4, seconds=1.0)  # the cores are taken: more would not help


def test_costs_are_cpu_per_token_smoothed_and_kept_without_tokens():
    w = [
        Window(cpu_s=2.0, produced=100_000, taken=90_000, starved=False),
        Window(cpu_s=0.01, produced=10, taken=0, starved=False),
    ]  # rings full: idle polling only
    costs = update_costs([None, 0.5], w)
    assert costs == [2e-5, 0.5]
    again = update_costs(costs, [Window(cpu_s=4.0, produced=100_000, taken=100_000, starved=False), w[1]])
    assert again[0] == 2e-5 * 0.5 + 4e-5 * 0.5


def test_demand_waits_for_a_cost_and_boosts_the_starved():
    quiet = Window(cpu_s=0.0, produced=0, taken=100, starved=False)
    assert demands([None, 1.0], [100, 100], [quiet, quiet]) is None
    starved = Window(cpu_s=0.0, produced=0, taken=100, starved=True)
    assert demands([1.0, 1.0], [100, 100], [quiet, starved]) == [100.0, 100.0 * STARVED_BOOST]
    assert demands([1.0], [0], [Window(cpu_s=0, produced=0, taken=0, starved=False)]) is None  # nothing to go by


def test_tokens_taken_remember_recent_bursts():
    burst = Window(cpu_s=0.0, produced=0, taken=1000, starved=False)
    quiet = Window(cpu_s=0.0, produced=0, taken=0, starved=False)
    taken = update_taken([0.0, 0.0], [burst, quiet])
    taken = update_taken(taken, [quiet, burst])
    assert taken == [TAKEN_MEMORY * 1000, 1000]


def test_resplit_moves_only_for_a_real_gain():
    lanes = [2, 2, 2, 2]
    even = pack(lanes, [1.0] * 4, 2)
    assert resplit(even, lanes, [1.0, 1.0, 1.0, 1.2], 2, MARGIN) is None  # within noise: stay
    # packed by equal weights, each worker already serves one lane of every source: the
    # costly source is spread, so there is nothing to gain
    assert workers_per_source(even, 4) == [2, 2, 2, 2]
    assert resplit(even, lanes, [10.0, 1.0, 1.0, 1.0], 2, MARGIN) is None


def test_resplit_from_a_bad_split_gains_and_settles():
    lanes = [2, 2, 2, 2]
    demand = [10.0, 1.0, 1.0, 1.0]
    bad = [[(0, 0), (0, 1)], [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]]
    better = resplit(bad, lanes, demand, 2, MARGIN)
    assert better is not None and _lanes_of(better) == _lanes_of(bad)
    assert busiest(better, lanes, demand) < busiest(bad, lanes, demand) / (1 + MARGIN)
    assert resplit(better, lanes, demand, 2, MARGIN) is None  # hysteresis: it stays put


def test_a_move_hands_over_only_the_lanes_that_change_worker():
    old = [[(0, 0)], [(1, 0)], [(2, 0), (3, 0)]]
    new = [[(2, 0)], [(3, 0), (0, 0)], [(1, 0)]]
    placed = keep_in_place(old, new)
    assert placed == [[(3, 0), (0, 0)], [(1, 0)], [(2, 0)]]  # each beside the lanes it keeps
    assert moves(old, placed) == Moves(released={2: [(3, 0)]}, taken={0: [(3, 0)]})
    assert _lanes_of(placed) == _lanes_of(new)


def test_a_source_turning_costly_keeps_its_producers_while_its_lanes_spread_out():
    """8 sources x 4 lanes on 8 workers, packed by weight: each worker serves one lane of four
    sources. s0 becomes ten times costlier: each of its lanes gets a worker of its own, the one
    already producing it, which only lets its cheap lanes go."""
    lanes, budget = [4] * 8, 8
    start = pack(lanes, [1.0] * 8, budget)  # a pool grown to its budget
    demand = [10.0] + [1.0] * 7
    plan = resplit(start, lanes, demand, budget, MARGIN)
    assert plan is not None and _lanes_of(plan) == _lanes_of(start)
    s0_workers = [i for i, w in enumerate(plan) if any(s == 0 for s, _ in w)]
    assert [plan[i] for i in s0_workers] == [[lane] for i in s0_workers for lane in start[i] if lane[0] == 0]
    carried = moves(start, plan)
    assert not set(carried.taken) & set(s0_workers)
    assert all(lane[0] != 0 for lanes in carried.released.values() for lane in lanes)


def test_pack_is_deterministic():
    assert pack([3, 1, 2], [2.0, 2.0, 1.0], 3) == pack([3, 1, 2], [2.0, 2.0, 1.0], 3)


def test_a_mostly_idle_pool_halves_down_to_one_worker_and_keeps_the_lanes():
    weights = [1.0] * 16
    plan = initial_plan(weights, 0, reserve=1, cpus=16)
    while (bigger := grow(plan, [4] * 16, weights)) is not None:
        plan = bigger
    sizes = [running(plan)]
    while (smaller := shrink(plan, [4] * 16, weights)) is not None:
        assert _lanes_of(smaller) == _lanes_of(plan) and len(smaller) == 15
        plan = smaller
        sizes.append(running(plan))
    assert sizes == [15, 7, 3, 1]
    quiet = [Window(cpu_s=0.5, produced=10**5, taken=10**5, starved=False, busy_s=0.5)]
    assert idle(quiet, workers=2, seconds=1.0)  # 25% of two workers' time
    assert not idle(quiet, workers=1, seconds=1.0)  # halved, it would be 50% busy: it stays
    assert not idle([Window(cpu_s=0.0, produced=0, taken=0, starved=True)], workers=4, seconds=1.0)
