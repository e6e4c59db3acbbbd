"""The central planner in real jobs: tensor-parallel groups (ranks in torchrun's environment), live mixing."""

from __future__ import annotations

import json
import os

import pytest
import torch

import omniload
from tests.corpus import mixed_sources
from tests.jobs import PROBE, ROOT, omniload_cli, run_as_torchrun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.mark.parametrize("broadcast_at", ["none", "tp"])
def test_tp_ranks_of_a_dp_group_see_identical_batches_and_dp_groups_are_disjoint(corpus, tmp_path, broadcast_at):
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "tp": 2, "steps": 12}
    with omniload.Job({**spec, "broadcast_at": broadcast_at}) as job:
        run_as_torchrun(job, 4, PROBE, str(tmp_path / "rank{rank}.json"))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(len(r["hashes"]) == 12 for r in ranks)
    assert ranks[0]["hashes"] == ranks[1]["hashes"], "tp ranks 0 and 1 (dp group 0) differ"
    assert ranks[2]["hashes"] == ranks[3]["hashes"], "tp ranks 2 and 3 (dp group 1) differ"
    assert not set(ranks[0]["sample_ids"]) & set(ranks[2]["sample_ids"]), "dp groups share samples"


@pytest.mark.parametrize("tokenizer", ["bytes", "tests.transforms_for_tests:slow_bytes"], ids=["fast", "slow-source"])
def test_live_mixture_change_applies_from_the_step_it_reports(corpus, tmp_path, tokenizer, monkeypatch):
    """With a slow source the change arrives while a step is being planned: the reply must
    still name the first step drawn with the new weights."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    spec = {
        "sources": mixed_sources(corpus),
        "seq_len": 256,
        "rows": 4,
        "workers": 3,
        "epochs": 0,
        "steps": 60,
        "tokenizer": tokenizer,
    }
    with omniload.Job(spec) as job:
        loader = omniload.connect(job.addr, job.token, rank=0, world_size=1)
        steps = []
        for _ in range(5):
            sources = next(loader)["source"].clone()
            steps.append((dict(loader.meta), sources))
        result = omniload_cli("mix", "--addr", job.addr, "--token", job.token, "--set", "web=1,code=0,books=0")
        assert result.returncode == 0, result.stderr
        changed_at = int(result.stdout.split("step")[-1])
        for batch in loader:
            steps.append((dict(loader.meta), batch["source"].clone()))
        bad = omniload_cli("mix", "--addr", job.addr, "--token", job.token, "--set", "nope=1")
        loader.close()
    assert bad.returncode == 2 and "unknown source(s) nope" in bad.stderr
    assert 5 <= changed_at < 40 and len(steps) == 60
    for number, (meta, _) in enumerate(steps[5:], start=5):
        expected = {"web": 1.0, "code": 0.0, "books": 0.0}
        assert (meta["weights"] == expected) == (number >= changed_at), number
    before = torch.cat([sources for _, sources in steps[:changed_at]])
    assert set(before[before >= 0].tolist()) == {0, 1, 2}
    # documents chosen before the change are still delivered (carried over); then only web
    tail = torch.cat([sources for _, sources in steps[-15:]])
    assert set(tail[tail >= 0].tolist()) == {0}


def test_a_mixture_change_before_the_first_step_keeps_the_other_weights(corpus, tmp_path):
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "workers": 3, "steps": 3}
    with omniload.Job(spec) as job:
        assert job.set_weights({"books": 0.6}) == 0
        with omniload.connect(job.addr, job.token, rank=0, world_size=1) as loader:
            next(loader)
            weights = loader.meta["weights"]
    assert weights == pytest.approx({"web": 0.6 / 1.5, "code": 0.3 / 1.5, "books": 0.6 / 1.5})


def test_context_parallel_row_slices_reassemble_into_the_full_rows(corpus):
    """With --cp-split row, cp ranks get int32 slices of the rows on the wire (a slice's labels
    need the whole row) and widen them: put back together they are the batch one rank gets
    without context parallelism (the sequence split: test_context_parallel.py)."""
    from omniload.coordinator.plan.parallel import cp_unslice

    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "workers": 3, "steps": 6}
    with omniload.Job(spec) as job, omniload.connect(job.addr, job.token, rank=0, world_size=1) as whole:
        full = [{k: v.clone() for k, v in batch.items()} for batch in whole]
    with omniload.Job({**spec, "cp": 2, "cp_split": "row"}) as job:
        ranks = [omniload.connect(job.addr, job.token, rank=r, world_size=2) for r in range(2)]
        sliced = [[{k: v.clone() for k, v in batch.items()} for batch in loader] for loader in ranks]
        for loader in ranks:
            loader.close()
    assert len(full) == len(sliced[0]) == len(sliced[1]) == 6
    for step, batch in enumerate(full):
        for name in ("input_ids", "labels", "position_ids"):
            parts = [sliced[r][step][name] for r in range(2)]
            assert all(p.dtype == torch.int64 and p.shape == (2, 32) for p in parts)
            assert torch.equal(torch.from_numpy(cp_unslice([p.numpy() for p in parts])), batch[name]), (step, name)
        for name in ("cu_seqlens", "source", "sample_id"):
            assert torch.equal(sliced[0][step][name], batch[name]) and torch.equal(sliced[1][step][name], batch[name])
