import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload import spec, spec_options
from omniload.batch_arrays import IGNORE_INDEX, PAD_ID, expand, trained_tokens
from omniload.coordinator.plan.packer import Segment, build_batch, compact_batch
from omniload.coordinator.plan.parallel import (
    CP_SPLITTERS,
    SLICED,
    cp_slice,
    cp_unslice,
    thd_slice,
    thd_unslice,
)
from omniload.errors import ConfigError
from omniload.layout import Layout

SEQ = 48


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


def _thd_by_the_rule(arrays: dict, cp: int, cp_rank: int) -> dict[str, list[int]]:
    """Transformer Engine's THD partition as its docs state it, one sequence at a time: pad the
    sequence to a multiple of 2*cp (no label on padding, positions running on), cut it into
    2*cp chunks, and give rank i chunks i and 2*cp-1-i. The reference thd_slice must match."""
    cu = [int(x) for x in arrays["cu_seqlens"]]
    flat = {name: arrays[name].reshape(-1).tolist() for name in SLICED}
    out: dict[str, list[int]] = {name: [] for name in SLICED}
    for start, end in zip(cu, cu[1:]):
        pad = (-(end - start)) % (2 * cp)
        sequence = {
            "input_ids": flat["input_ids"][start:end] + [PAD_ID] * pad,
            "labels": flat["labels"][start:end] + [IGNORE_INDEX] * pad,
            "position_ids": flat["position_ids"][start:end]
            + [flat["position_ids"][end - 1] + 1 + k for k in range(pad)],
        }
        size = (end - start + pad) // (2 * cp)
        for name, tokens in sequence.items():
            chunks = [tokens[k * size : (k + 1) * size] for k in range(2 * cp)]
            out[name] += chunks[cp_rank] + chunks[2 * cp - 1 - cp_rank]
    return out


@st.composite
def _packed_rows(draw):
    """A rank's packed rows: documents of any length, later chunks of bucketed documents
    (positions that do not start at 0) and padding at a row's end."""
    rows, ordinal = [], 0
    for _ in range(draw(st.integers(1, 3))):
        row, room = [], SEQ
        while room and draw(st.booleans()):
            length = draw(st.integers(1, room))
            start = draw(st.sampled_from([0, 0, 0, SEQ]))
            tokens = np.array(draw(st.lists(st.integers(1, 2**31 - 1), min_size=length, max_size=length)), np.int32)
            row.append(Segment(draw(st.integers(0, 3)), ordinal, length, tokens, position_start=start))
            ordinal += 1
            room -= length
        rows.append(row)
    return rows


@settings(max_examples=150, deadline=None)
@given(rows=_packed_rows(), cp=st.sampled_from([2, 3, 4]))
def test_sequence_split_matches_the_documented_thd_partition(rows, cp):
    batch = build_batch(rows, SEQ)
    for cp_rank in range(cp):
        got, want = thd_slice(batch, cp, cp_rank), _thd_by_the_rule(batch, cp, cp_rank)
        for name in SLICED:
            assert got[name].shape == (1, len(want[name])), name
            assert got[name].reshape(-1).tolist() == want[name], (name, cp_rank)
        assert (got["cu_seqlens"] == batch["cu_seqlens"]).all()
        assert (got["source"] == batch["source"]).all() and (got["sample_id"] == batch["sample_id"]).all()


@settings(max_examples=150, deadline=None)
@given(rows=_packed_rows(), cp=st.sampled_from([2, 3, 4]), flat=st.booleans())
def test_every_cp_group_reassembles_the_exact_sequences(rows, cp, flat):
    """Whatever the rows (or one flat row of any length), the cp ranks' slices put back together
    are the sequences whole: ids, labels and positions; every rank holds the same number of
    tokens, each sequence's padded length is a multiple of 2*cp, and the labels the ranks train
    on add up to the batch's."""
    batch = expand(compact_batch(rows, SEQ))
    if flat:  # the shape a variable-length rank batch takes: one row, packed
        batch = {**batch, **{name: batch[name].reshape(1, -1) for name in SLICED}}
    slices = [thd_slice(batch, cp, i) for i in range(cp)]
    padded = slices[0]["cu_seqlens_padded"]
    assert (np.diff(padded) % (2 * cp) == 0).all() and (np.diff(padded) - np.diff(batch["cu_seqlens"]) < 2 * cp).all()
    assert len({s["input_ids"].shape for s in slices}) == 1
    for name in SLICED:
        whole = thd_unslice([s[name] for s in slices], batch["cu_seqlens"], padded)
        assert (whole == batch[name].reshape(-1)).all(), name
    trained = sum(int((s["labels"] != IGNORE_INDEX).sum()) for s in slices)
    assert trained == int((batch["labels"] != IGNORE_INDEX).sum()) == trained_tokens([compact_batch(rows, SEQ)])


def test_sequence_split_takes_chunks_i_and_mirror_of_every_sequence():
    # TE's own example: [1..8] over cp=2 -> [1, 2, 7, 8] and [3, 4, 5, 6]; then a 3-token
    # sequence, padded to 4: [9, 10, 11, pad] -> [9, pad] and [10, 11]
    ids = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    batch = {"input_ids": ids, "labels": ids + 100, "position_ids": ids - 1, "cu_seqlens": np.array([0, 8, 11])}
    first, second = thd_slice(batch, 2, 0), thd_slice(batch, 2, 1)
    assert first["input_ids"].tolist() == [[1, 2, 7, 8, 9, PAD_ID]]
    assert second["input_ids"].tolist() == [[3, 4, 5, 6, 10, 11]]
    assert first["labels"].tolist() == [[101, 102, 107, 108, 109, IGNORE_INDEX]]
    assert first["position_ids"].tolist() == [[0, 1, 6, 7, 8, 11]]  # the pad's position runs on
    assert first["cu_seqlens_padded"].tolist() == [0, 8, 12]


def test_the_spec_names_every_split_there_is(tmp_path):
    assert set(spec_options.CP_SPLITS) == set(CP_SPLITTERS)
    assert spec.Spec.from_dict({"sources": ["web=x.parquet"], "cp": 2}).cp_split == "sequence"
    (tmp_path / "job.yaml").write_text("sources: ['web=x.parquet']\ncp: 2\ncp-split: row\n")
    assert spec.Spec.from_dict(spec.load_config(tmp_path / "job.yaml")).cp_split == "row"
    with pytest.raises(ConfigError, match="cp-split must be one of .*'sequence'.*got 'rows'"):
        spec.Spec.from_dict({"sources": ["web=x.parquet"], "cp_split": "rows"})
