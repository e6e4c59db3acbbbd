import numpy as np
import pytest

from omniload.coordinator.plan.packer import Segment, build_batch
from omniload.coordinator.plan.parallel import SLICED, cp_slice, cp_unslice
from omniload.layout import Layout


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_slices_reassemble_into_the_rows_with_consistent_labels_and_positions(cp):
    rng = np.random.default_rng(0)
    segs = [Segment(0, i, n, rng.integers(1, 200, n).astype(np.int32)) for i, n in enumerate([5, 9, 2, 7, 16])]
    batch = build_batch([segs[:2], segs[2:4], segs[4:]], seq_len=16)
    slices = [cp_slice(batch, cp, i) for i in range(cp)]
    for name in SLICED:
        assert all(s[name].shape == (3, 16 // cp) for s in slices)
        assert (cp_unslice([s[name] for s in slices]) == batch[name]).all()
    assert all((s["cu_seqlens"] == batch["cu_seqlens"]).all() for s in slices)


def test_cp_rank_takes_chunks_i_and_mirror():
    row = {name: np.arange(8).reshape(1, 8) for name in SLICED}
    assert cp_slice(row, 2, 0)["input_ids"].tolist() == [[0, 1, 6, 7]]
    assert cp_slice(row, 2, 1)["input_ids"].tolist() == [[2, 3, 4, 5]]


def test_custom_rank_order_and_groups():
    layout = Layout(world=8, tp=2, pp=2, order="tp-pp-dp-cp")
    assert [layout.coords(r)["pp"] for r in range(4)] == [0, 0, 1, 1]
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(layout.rank_of(layout.coords(r)) == r for r in range(8))
    assert layout.group(5, "tp") == [4, 5]


def test_pipeline_stages_and_broadcast():
    layout = Layout(world=12, tp=2, pp=3)
    stages = [layout.coords(r)["pp"] for r in range(12)]
    assert [layout.needs_data(r) for r in range(12)] == [s != 1 for s in stages]
    assert all(layout.needs_data(r, "all") for r in range(12))
    assert [layout.connects(r, "tp") for r in range(4)] == [True, False, True, False]
