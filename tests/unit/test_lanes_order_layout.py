import numpy as np
import pytest

from omniload.coordinator.pool.lane_split import assign_lanes, lanes_per_source
from omniload.errors import ConfigError
from omniload.layout import Layout
from omniload.order import (
    TURN,
    ShardOrder,
    Slicing,
    group_members,
    groups_per_epoch,
    index_dtype,
    interleave_rows,
    lane_of,
    row_permutation,
    sample_id,
    shard_permutation,
    turns_of_lane,
)


def test_budget_goes_to_heavier_sources():
    assert lanes_per_source([0.6, 0.3, 0.1], 6) == [3, 2, 1]
    assert sum(lanes_per_source([0.5, 0.25, 0.25], 11)) == 11
    assert lanes_per_source([1, 1, 1], 2) == [1, 1, 1]


def test_fewer_workers_than_sources_share_workers():
    weights = [0.4] + [0.02] * 30
    workers = assign_lanes(weights, 4)
    assert len(workers) == 4
    lanes = sorted(lane for w in workers for lane in w)
    assert lanes == [(s, 0) for s in range(31)]
    assert workers[0] == [(0, 0)]  # the heavy source gets a worker to itself


def test_one_lane_per_worker_when_budget_allows():
    workers = assign_lanes([0.6, 0.3, 0.1], 6)
    assert sorted(w[0] for w in workers) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]


def test_lanes_take_turns_on_every_position_of_a_group_once():
    size = 3 * TURN + 17
    for lanes in (1, 2, 3, 5):
        for k in range(4):
            for start in (0, 5, TURN, TURN + 40, size - 1):
                turns = {lane: list(turns_of_lane(lane, lanes, k, size, start)) for lane in range(lanes)}
                produced = sorted(pos for runs in turns.values() for run in runs for pos in run)
                assert produced == list(range(start, size))
                for lane, runs in turns.items():
                    assert all(lane_of(k, pos, lanes) == lane for run in runs for pos in run)
                    assert all(len(run) <= TURN for run in runs)
    # consecutive turns go to different lanes, so a source's lanes work at once
    assert [lane_of(0, pos, 2) for pos in (0, TURN - 1, TURN, 2 * TURN)] == [0, 0, 1, 0]


def test_groups_cover_each_epoch_once_and_never_mix_epochs():
    for shards, k in [(10, 4), (3, 4), (1, 4), (8, 1), (7, 7)]:
        per_epoch = groups_per_epoch(shards, k)
        members = [list(group_members(j, shards, k)) for j in range(3 * per_epoch)]
        assert [g for m in members for g in m] == list(range(3 * shards))
        assert all(len({g // shards for g in m}) == 1 and 1 <= len(m) <= k for m in members)


def test_interleave_takes_rows_of_each_shard_in_turn():
    member, row = interleave_rows([3, 1, 2])
    assert list(zip(member.tolist(), row.tolist())) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]
    member, row = interleave_rows([5])
    assert member.tolist() == [0] * 5 and row.tolist() == list(range(5))
    # consecutive positions come from different shards while more than one has rows left
    member, _ = interleave_rows([50, 40, 60, 45])
    assert (member[1:181] != member[:180]).all()


def test_permutations_are_seeded_per_epoch_and_source():
    assert (shard_permutation(10, 7, 0, 0) == shard_permutation(10, 7, 0, 0)).all()
    assert sorted(shard_permutation(10, 7, 0, 1)) == list(range(10))
    assert (shard_permutation(50, 7, 0, 0) != shard_permutation(50, 7, 0, 1)).any()
    assert (shard_permutation(50, 7, 0, 0) != shard_permutation(50, 7, 1, 0)).any()
    assert (row_permutation(50, 7, 0, 0, 3) != row_permutation(50, 7, 0, 0, 4)).any()
    for rows in (0, 1):  # nothing to shuffle: no generator seeded, the dtype of any other shard's
        assert row_permutation(rows, 7, 0, 0, 3).tolist() == list(range(rows))
        assert row_permutation(rows, 7, 0, 0, 3).dtype == row_permutation(50, 7, 0, 0, 3).dtype
    epoch, shard = ShardOrder(10, 7, 0).at(23)
    assert epoch == 2 and shard == shard_permutation(10, 7, 0, 2)[3]


def test_the_shard_order_answers_as_a_permutation_drawn_afresh_whatever_it_keeps():
    order = ShardOrder(7, 3, 1)
    # forward, into the next epoch, back one, and back past the epochs it keeps (a resumed lane)
    for g in [0, 6, 7, 13, 20, 1, 14, 2, 30, 8, 0]:
        epoch, position = divmod(g, 7)
        assert order.at(g) == (epoch, int(shard_permutation(7, 3, 1, epoch)[position]))


def test_sample_ids_are_distinct_across_sources_ordinals_and_chunks():
    ids = {sample_id(s, o, c) for s in range(3) for o in (0, 1, 2**39) for c in (0, 1, 4095)}
    assert len(ids) == 27 and all(0 <= i < 2**63 for i in ids)


def test_megatron_rank_order():
    layout = Layout(world=16, tp=2, cp=2, pp=2)
    assert layout.dp == 2
    # tp fastest, then cp, then dp, then pp
    assert [layout.dp_rank(r) for r in range(16)] == [0, 0, 0, 0, 1, 1, 1, 1] * 2


def test_world_not_divisible_by_the_layout():
    with pytest.raises(ConfigError, match="world size 6 is not divisible by tp\\*pp\\*cp = 4\\*1\\*1 = 4"):
        Layout(world=6, tp=4)


def test_a_workers_row_indexes_take_four_bytes_a_row():
    """A worker holds these for every shard and group it reads; large row groups make them its
    largest arrays. Eight bytes a row only where four cannot count the rows."""
    rows = 100_000
    for slicing in (None, Slicing(rows, rows // 16, strided=True)):
        order = row_permutation(rows, 7, 0, 0, 3, slicing)
        assert order.nbytes == 4 * rows and sorted(order.tolist()) == list(range(rows))
    member, row = interleave_rows([rows, rows])
    assert member.nbytes + row.nbytes == 8 * 2 * rows
    assert row.max() == rows - 1
    assert index_dtype(2**31 - 1) == np.int32 and index_dtype(2**31) == np.int64
