"""Loss normalisation in a real 2-rank job, the ranks in torchrun's environment (gloo, CPU): the
demo's gradient is the one of the unsplit global batch, though the ranks hold unequal numbers of
labelled tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

import omniload
from tests.corpus import mixed_sources
from tests.jobs import ROOT, run_as_torchrun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 30  # the first steps of the shuffle may all be full chunks (equal counts): enough for unequal ones


def test_the_demo_gradient_is_the_global_batch_gradient_and_the_meta_counts_every_rank(corpus, tmp_path):
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "steps": STEPS, "workers": 3}
    with omniload.Job(spec) as job:
        run_as_torchrun(job, 2, ROOT / "tests" / "loss_scale_probe.py", str(tmp_path), str(STEPS))
    counts = json.loads((tmp_path / "counts.json").read_text())
    assert len(counts) == STEPS
    for step in counts:  # the same count on every rank: the sum of the ranks' labelled tokens
        assert step["meta"] == [sum(step["labelled"])] * 2, step
    assert any(len(set(step["labelled"])) > 1 for step in counts), "the ranks' counts differ: the case that matters"
    with np.load(tmp_path / "grads.npz") as grads:
        for step in range(STEPS):
            ddp, whole, naive = grads[f"{step}/ddp"], grads[f"{step}/global"], grads[f"{step}/naive"]
            scale = np.abs(whole).max()
            np.testing.assert_allclose(ddp, whole, rtol=0, atol=1e-5 * scale, err_msg=f"step {step}")
            if len(set(counts[step]["labelled"])) > 1:  # averaging the ranks' mean losses is off by more
                assert np.abs(naive - whole).max() > 1e-3 * scale, step
