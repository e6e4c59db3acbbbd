"""bench_quality's chunks with a document mask: the same rows, cut where their documents are."""

from __future__ import annotations

import numpy as np

from scripts.bench_quality import DP, SEQ, chunks_steps, with_document_mask


def _documents(seed: int) -> list[list[np.ndarray]]:
    """Three sources of documents from empty to several rows long, some exactly a row."""
    rng = np.random.default_rng(seed)
    lengths = [0, 1, SEQ, 2 * SEQ, 3 * SEQ + 7] + [int(n) for n in rng.integers(1, 3 * SEQ, 40)]
    return [[rng.integers(0, 256, n).astype(np.uint8) for n in lengths] for _ in range(3)]


def test_each_piece_attends_to_itself_and_its_last_token_predicts_nothing():
    steps = chunks_steps(_documents(0), rows=4, steps=6, seed=1)  # several epochs of the small sources
    for plain_step, step in zip(steps, with_document_mask(steps)):
        assert len(step) == DP
        for plain, b in zip(plain_step, step):
            assert (b.input_ids == plain.input_ids).all(), "the rows are the chunks' own"
            bounds = b.cu_seqlens
            assert (np.diff(bounds) > 0).all(), "no empty piece"
            assert set(range(0, b.input_ids.size + 1, SEQ)) <= set(bounds.tolist()), "no piece crosses a row"
            ids, labels, positions = (a.reshape(-1) for a in (b.input_ids, b.labels, b.position_ids))
            for start, stop in zip(bounds[:-1], bounds[1:]):
                assert (positions[start:stop] == np.arange(stop - start)).all()
                assert labels[stop - 1] == -100
                assert (labels[start : stop - 1] == ids[start + 1 : stop]).all()
