"""DESIGN.md invariant 1: the batches are a function of spec, seed and files only."""
from __future__ import annotations

import pytest

from tests.corpus import mixed_sources
from tests.jobs import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_first_50_batches_are_identical_across_worker_counts_and_runs(corpus, tmp_path):
    base = {"sources": mixed_sources(corpus, (0.4, 0.35, 0.25)), "seq_len": 64, "rows": 2, "seed": 5,
            "epochs": 0, "steps": 50}
    one_per_source = run_ranks({**base, "workers": 3}, world=2, out_dir=tmp_path)
    three_per_source = run_ranks({**base, "workers": 9}, world=2, out_dir=tmp_path)
    again = run_ranks({**base, "workers": 3}, world=2, out_dir=tmp_path)

    for rank in range(2):
        hashes = one_per_source[rank]["hashes"]
        assert len(hashes) == 50
        assert three_per_source[rank]["hashes"] == hashes, f"rank {rank}: worker count changed the data"
        assert again[rank]["hashes"] == hashes, f"rank {rank}: a second run changed the data"
    assert one_per_source[0]["hashes"] != one_per_source[1]["hashes"]


def test_a_different_seed_gives_different_batches(corpus, tmp_path):
    base = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "workers": 3, "steps": 5}
    a = run_ranks({**base, "seed": 1}, world=1, out_dir=tmp_path)
    b = run_ranks({**base, "seed": 2}, world=1, out_dir=tmp_path)
    assert a[0]["hashes"] != b[0]["hashes"]
