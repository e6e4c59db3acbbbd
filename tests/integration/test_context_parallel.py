"""Context parallelism on packed sequences, ranks in torchrun's environment (gloo, CPU): what a
cp=2 job's ranks get, put back together, is what the same job without context parallelism
delivers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import omniload
from omniload.coordinator.plan.parallel import SLICED, thd_unslice
from tests.corpus import mixed_sources
from tests.jobs import ROOT, lockstep_batches, run_as_torchrun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DUMP = ROOT / "tests" / "batch_dump.py"
STEPS = 6


def _run_dump_ranks(spec: dict, out: Path, nproc: int) -> list[tuple[dict, list]]:
    """Run the job with `nproc` ranks under torchrun's environment; each rank's (arrays, metas)."""
    out.mkdir()
    with omniload.Job(spec) as job:
        run_as_torchrun(job, nproc, DUMP, str(out))
    ranks = []
    for rank in range(nproc):
        with np.load(out / f"rank{rank}.npz") as npz:
            arrays = dict(npz)
        ranks.append((arrays, json.loads((out / f"rank{rank}.json").read_text())))
    return ranks


@pytest.mark.parametrize("rank_tokens", ["fixed", "variable"])
def test_each_cp_group_reassembles_the_sequences_the_job_without_cp_delivers(corpus, tmp_path, rank_tokens):
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "steps": STEPS, "workers": 3}
    spec["rank_tokens"] = rank_tokens
    # the job without cp, dp = 2, as its two ranks get it (two loaders in this process)
    whole = lockstep_batches(spec, world=2)
    split = _run_dump_ranks({**spec, "cp": 2}, tmp_path / "cp2", 4)  # dp = 2, cp ranks 2d and 2d+1 (tp-cp-dp-pp)
    for step in range(STEPS):
        counts = {meta[step]["global_trained_tokens"] for _, meta in whole + split}
        want_count = sum(int((arrays[f"{step}/labels"] != -100).sum()) for arrays, _ in whole)
        assert counts == {want_count}, (step, counts, want_count)
        assert sum(int((arrays[f"{step}/labels"] != -100).sum()) for arrays, _ in split) == want_count
        for dp_rank, (full, _) in enumerate(whole):
            group = [split[2 * dp_rank][0], split[2 * dp_rank + 1][0]]
            cu, padded = group[0][f"{step}/cu_seqlens"], group[0][f"{step}/cu_seqlens_padded"]
            for name in ("cu_seqlens", "source", "sample_id"):
                assert all(np.array_equal(g[f"{step}/{name}"], full[f"{step}/{name}"]) for g in group), (step, name)
            assert np.array_equal(group[1][f"{step}/cu_seqlens_padded"], padded)
            assert (np.diff(padded) % 4 == 0).all()
            for name in SLICED:
                parts = [g[f"{step}/{name}"] for g in group]
                assert all(p.dtype == np.int64 and p.shape == (1, padded[-1] // 2) for p in parts), (step, name)
                rebuilt = thd_unslice(parts, cu, padded)
                assert np.array_equal(rebuilt, full[f"{step}/{name}"].reshape(-1)), (step, dp_rank, name)
