"""--rank-tokens variable in real jobs: each data-parallel rank its own sequence length, every
document delivered once, the batches of the uninterrupted run after a resume. (The flags give
the job of the dict: tests/unit/test_spec.py.)"""

from __future__ import annotations

from collections import Counter

import pytest

import omniload
from tests.corpus import mixed_sources
from tests.jobs import collect, run_ranks, start_ranks, wait_for_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SEQ, ROWS, DP, PAD = 512, 2, 3, 16
# attention matters from 64 tokens up, so a rank holding a 512-token chunk costs far more a token
COEFFS = "1,64,0"


def _spec(corpus, rank_tokens: str) -> dict:
    return {
        "sources": mixed_sources(corpus),
        "seq_len": SEQ,
        "rows": ROWS,
        "seed": 7,
        "cost_coeffs": COEFFS,
        "rank_tokens": rank_tokens,
        "pad_to": PAD,
    }


def test_ranks_get_their_own_lengths_and_every_document_once(corpus, tmp_path):
    ranks = run_ranks(_spec(corpus, "variable"), world=DP, out_dir=tmp_path)
    steps = len(ranks[0]["hashes"])
    assert steps > 20 and all(len(r["hashes"]) == steps for r in ranks)

    # one packed sequence a rank, padded to a multiple of --pad-to, within 2 x rows x seq_len
    shapes = [[r["shapes"][k] for r in ranks] for k in range(steps)]
    assert all(rows == 1 and length % PAD == 0 and length <= 2 * ROWS * SEQ for s in shapes for rows, length in s)
    assert sum(len({length for _, length in s}) > 1 for s in shapes) > steps // 2, "ranks should differ in length"

    # every step full (but the last, where the data ends), no document twice in a step or a run
    real = [sum(n for r in ranks for sid, n, _ in r["step_segments"][k] if sid >= 0) for k in range(steps)]
    assert min(real[:-2]) >= 0.9 * DP * ROWS * SEQ, real
    assert sum(real[:-2]) / (steps - 2) >= 0.97 * DP * ROWS * SEQ
    # the coordinator's balance, the same in every rank's meta: max rank cost over the lower
    # bound max(mean, costliest segment); ~1.05 here, where a step holds a few 512-token chunks
    to_bound = ranks[0]["to_bound"][:-2]
    assert all(r["to_bound"] == ranks[0]["to_bound"] for r in ranks)
    assert min(to_bound) >= 1.0 and sum(to_bound) / len(to_bound) <= 1.1, to_bound
    delivered = Counter(sid for r in ranks for sid in r["sample_ids"])
    assert max(delivered.values()) == 1, "a segment was delivered twice"

    # the same segments as fixed rows deliver over the epoch: only where they go differs
    fixed = run_ranks(_spec(corpus, "fixed"), world=DP, out_dir=tmp_path)
    assert set(delivered) == {sid for r in fixed for sid in r["sample_ids"]}


def test_a_resumed_variable_job_continues_with_the_batches_of_the_uninterrupted_run(corpus, tmp_path):
    spec = {**_spec(corpus, "variable"), "seq_len": 64, "cost_coeffs": "1,8,0", "pad_to": 8, "steps": 40}
    reference = run_ranks(spec, world=2, out_dir=tmp_path)
    folder = tmp_path / "ckpt"
    with omniload.Job({**spec, "checkpoint_dir": str(folder), "snapshot_every": 7}) as job:
        collect(start_ranks(job, 2, tmp_path, max_steps=15))
        assert wait_for_checkpoint(folder, 15, timeout=10) == 15
    with omniload.Job({**spec, "resume": str(folder)}) as job:
        resumed = collect(start_ranks(job, 2, tmp_path))
    for rank in range(2):
        assert resumed[rank]["steps"] == list(range(15, 40))
        assert resumed[rank]["hashes"] == reference[rank]["hashes"][15:], f"rank {rank} differs after resume"
        assert len({length for _, length in reference[rank]["shapes"]}) > 1  # lengths vary from step to step
