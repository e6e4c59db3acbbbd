import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload.coordinator.plan.packer import (
    IGNORE_INDEX,
    Segment,
    build_batch,
    chunk_bounds,
    compact_batch,
    compact_batches,
)


def _segments(lengths, source=0):
    return [Segment(source, i, n, np.arange(1, n + 1, dtype=np.int32) + 1000 * i) for i, n in enumerate(lengths)]


def test_chunks_cover_a_long_document_exactly():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(4, 4) == [(0, 4)]
    assert chunk_bounds(0, 4) == []


def test_batch_schema():
    segs = _segments([3, 5, 2])
    batch = build_batch([[segs[0], segs[1]], [segs[2]]], seq_len=8)
    assert {k: (v.dtype.name, v.shape) for k, v in batch.items()} == {
        "input_ids": ("int64", (2, 8)),
        "labels": ("int64", (2, 8)),
        "position_ids": ("int64", (2, 8)),
        "cu_seqlens": ("int32", (5,)),
        "source": ("int64", (4,)),
        "sample_id": ("int64", (4,)),
    }
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 10, 16]  # 3 | 5 || 2 | padding 6
    assert batch["source"].tolist() == [0, 0, 0, -1]
    assert batch["sample_id"].tolist() == [0, 1, 2, -1]
    assert batch["input_ids"].tolist() == [[1, 2, 3, 1001, 1002, 1003, 1004, 1005], [2001, 2002, 0, 0, 0, 0, 0, 0]]
    x = IGNORE_INDEX
    assert batch["labels"].tolist() == [[2, 3, x, 1002, 1003, 1004, 1005, x], [2002, x, x, x, x, x, x, x]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(1, 16), max_size=4), min_size=1, max_size=4))
def test_no_segment_crosses_a_row_and_labels_stay_inside_segments(row_lengths):
    seq_len = 64
    rows = [_segments(lengths) for lengths in row_lengths]
    batch = build_batch(rows, seq_len)
    cu = batch["cu_seqlens"]
    assert cu[0] == 0 and cu[-1] == len(rows) * seq_len
    row_starts = set(range(0, len(rows) * seq_len + 1, seq_len))
    ends = set(cu.tolist())
    assert row_starts <= ends  # every row boundary is a segment boundary
    labels, ids = batch["labels"].ravel(), batch["input_ids"].ravel()
    for start, stop, source in zip(cu[:-1], cu[1:], batch["source"]):
        assert labels[stop - 1] == IGNORE_INDEX
        if source >= 0:
            assert (labels[start : stop - 1] == ids[start + 1 : stop]).all()
        else:
            assert (labels[start:stop] == IGNORE_INDEX).all()
        assert batch["position_ids"].ravel()[start:stop].tolist() == list(range(stop - start))


def test_positions_run_on_across_the_rows_of_a_bucketed_document():
    tokens = np.arange(1, 11, dtype=np.int32)
    first = Segment(0, 0, 6, tokens[:6], group=0)
    second = Segment(0, 1, 4, tokens[6:], position_start=6, group=0)
    batch = build_batch([[first], [second]], seq_len=6)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 0, 1]]


def _reference_batch(rows, seq_len, image_hw, masked):
    """The batch schema's wire arrays built segment by segment, as the packer did before it
    built a step at once: the definition compact_batches must keep."""
    ids, trained = np.zeros((len(rows), seq_len), np.int32), np.zeros(len(rows) * seq_len, bool)
    lengths, sources, sample_ids, starts, images, image_index = [], [], [], [], [], []
    for r, row in enumerate(rows):
        offset = r * seq_len
        for s in row:
            ids.reshape(-1)[offset : offset + s.length] = s.tokens
            trained[offset : offset + s.length] = True if s.mask is None else s.mask
            offset += s.length
            if s.images is not None:
                images.append(s.images)
                image_index += [len(lengths)] * len(s.images)
            lengths.append(s.length)
            sources.append(s.source)
            sample_ids.append(s.sample_id)
            starts.append(s.position_start)
        if (r + 1) * seq_len > offset:
            lengths.append((r + 1) * seq_len - offset)
            sources.append(-1)
            sample_ids.append(-1)
            starts.append(0)
    wire = {
        "input_ids": ids,
        "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        "source": np.array(sources, np.int32),
        "sample_id": np.array(sample_ids, np.int64),
    }
    if any(starts):
        wire["position_start"] = np.array(starts, np.int32)
    if masked:
        wire["label_mask"] = np.packbits(trained)
    if image_hw is not None:
        wire["pixel_values"] = np.concatenate(images) if images else np.zeros((0, 3, *image_hw), np.uint8)
        wire["image_index"] = np.array(image_index, np.int64)
    return wire


def test_a_steps_batches_built_at_once_are_each_ranks_own():
    """compact_batches builds every rank of a step in one pass over shared arrays: each rank's
    arrays (offsets, padding, images and masks included) must be what that rank's rows give
    when built segment by segment, and what compact_batch gives for that rank alone."""
    rng = np.random.default_rng(3)
    hw = (2, 2)

    def segment(i: int, width: int) -> Segment:
        n = int(rng.integers(1, width + 1))
        images = rng.integers(0, 255, (int(rng.integers(1, 3)), 3, *hw), dtype=np.uint8) if i % 3 == 0 else None
        mask = rng.integers(0, 2, n, dtype=np.uint8) if i % 4 == 1 else None
        tokens = rng.integers(0, 60_000, n).astype(np.uint16 if i % 2 else np.int32)
        return Segment(i % 3, 100 + i, n, tokens, position_start=i % 5, images=images, mask=mask)

    widths, rows = [8, 5, 12, 6], 2
    ranks, count = [], 0
    for width in widths:
        rank_rows = []
        for _ in range(rows):
            row, used = [], 0
            while rng.random() < 0.7 and used < width:
                s = segment(count, width - used)
                count, used = count + 1, used + s.length
                row.append(s)
            rank_rows.append(row)
        ranks.append(rank_rows)
    ranks[-1] = [[], []]  # a rank with no segment: all padding
    segments = [s for rank_rows in ranks for row in rank_rows for s in row]
    bounds = [0]
    for rank_rows in ranks:
        for row in rank_rows:
            bounds.append(bounds[-1] + len(row))
    for image_hw, masked in [(hw, True), (None, False), (None, True), (hw, False)]:
        together = compact_batches(segments, bounds, rows, widths, image_hw, masked)
        for rank_rows, width, wire in zip(ranks, widths, together):
            for expected in (
                _reference_batch(rank_rows, width, image_hw, masked),
                compact_batch(rank_rows, width, image_hw, masked),
            ):
                assert wire.keys() == expected.keys()
                for name in expected:
                    assert wire[name].dtype == expected[name].dtype, name
                    np.testing.assert_array_equal(wire[name], expected[name], err_msg=name)
        if image_hw is not None:
            assert sum(len(w["pixel_values"]) for w in together) == sum(s.image_count for s in segments) > 0
    assert compact_batch([], 4)["input_ids"].shape == (0, 4)  # no rows at all
