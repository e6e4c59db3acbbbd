"""The batches are a function of spec, seed and files only (docs/architecture.md, Invariants,
"Deterministic")."""

from __future__ import annotations

import pytest

from tests.corpus import mixed_sources
from tests.jobs import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# The first test's 50 steps of both ranks, every array: a change that moves any batch must say so
# here, in the commit that changes the order on purpose (docs/planning.md says what the order is).
PINNED_BATCHES = "ecda30375281fb00"


def _digest(ranks: list[dict]) -> str:
    import hashlib

    return hashlib.blake2b("".join(h for rank in ranks for h in rank["hashes"]).encode(), digest_size=8).hexdigest()


def test_first_50_batches_are_identical_across_worker_counts_and_runs(corpus, tmp_path):
    base = {
        "sources": mixed_sources(corpus, (0.4, 0.35, 0.25)),
        "seq_len": 64,
        "rows": 2,
        "seed": 5,
        "epochs": 0,
        "steps": 50,
    }
    one_per_source = run_ranks({**base, "workers": 3}, world=2, out_dir=tmp_path)
    three_per_source = run_ranks({**base, "workers": 9}, world=2, out_dir=tmp_path)
    again = run_ranks({**base, "workers": 3}, world=2, out_dir=tmp_path)

    for rank in range(2):
        hashes = one_per_source[rank]["hashes"]
        assert len(hashes) == 50
        assert three_per_source[rank]["hashes"] == hashes, f"rank {rank}: worker count changed the data"
        assert again[rank]["hashes"] == hashes, f"rank {rank}: a second run changed the data"
    assert one_per_source[0]["hashes"] != one_per_source[1]["hashes"]
    got = _digest(one_per_source)
    assert got == PINNED_BATCHES, (
        f"the batches changed: {got} != pinned {PINNED_BATCHES}; a refactor must not move them, and a "
        "commit that changes the order on purpose sets PINNED_BATCHES and says why"
    )


def test_a_different_seed_gives_different_batches(corpus, tmp_path):
    base = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "workers": 3, "steps": 5}
    a = run_ranks({**base, "seed": 1}, world=1, out_dir=tmp_path)
    b = run_ranks({**base, "seed": 2}, world=1, out_dir=tmp_path)
    assert a[0]["hashes"] != b[0]["hashes"]


def _autoscaled_and_static(corpus, tmp_path, monkeypatch, steps: int, env: dict[str, str] | None = None) -> tuple:
    """Two ranks read a job under --workers auto with a budget of two workers, and again under a
    static split of two. Eight sources (the corpus' files under several names), two of them
    hundreds of times costlier per token: packed by weight, sources 0, 2, 4, 6 share a worker.
    The costly two are copies of one source: burn_bytes costs per document, so its cost per
    token follows the documents' length. Returns (autoscaled ranks, static ranks, the workers'
    status read every 0.1 s while the autoscaled job ran). The static job burns no CPU: only its
    batches matter."""
    import os
    import threading

    import omniload
    from tests.jobs import collect, start_ranks

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs for a budget of 2 workers")
    sources = [dict(s, name=f"{s['name']}{i}") for i in range(3) for s in mixed_sources(corpus, (1.0, 1.0, 1.0))][:8]
    for costly in (0, 6):
        sources[costly]["tokenizer"] = "tests.transforms_for_tests:burn_bytes"
    base = {"sources": sources, "seq_len": 512, "rows": 4, "seed": 3, "epochs": 0, "steps": steps, "ring_mb": 1}
    with monkeypatch.context() as free:
        free.setenv("BURN_BYTES_ROUNDS", "0")
        static = run_ranks({**base, "workers": 2}, world=2, out_dir=tmp_path)
    auto = {**base, "workers": "auto", "reserve_cpus": len(os.sched_getaffinity(0)) - 2, "autoscale_every": 0.5}
    readings: list[dict] = []
    with omniload.Job(auto) as job:
        ranks = start_ranks(job, 2, tmp_path, env=env)
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.1):
                try:
                    readings.append(job.status()["workers"])
                except omniload.OmniloadError:
                    return  # the job ended

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        scaled = collect(ranks, timeout=150)
        done.set()
        watcher.join(10)
    return scaled, static, readings


def test_autoscaling_grows_moves_and_shrinks_the_pool_without_changing_the_data(corpus, tmp_path, monkeypatch):
    """--workers auto grows the pool and re-splits it by measured cost while the job fills its
    shuffle window, then shrinks it again, stopping a worker, once the ranks take their batches
    slowly (a long training step) and the workers idle: the batches are those of a static split
    throughout. The pool starts with one worker, which the costly sources keep busy while they
    starve, so it grows to two, and the measured costs part the costly two."""
    # 400 steps as fast as the ranks can (the pool grows and moves: it grows while the window
    # fills, before the first step), then 60 of 0.15 s (it shrinks, a second or two in)
    slow = {"PROBE_SLOW_AFTER": "400", "PROBE_STEP_S": "0.15"}
    scaled, static, readings = _autoscaled_and_static(corpus, tmp_path, monkeypatch, steps=460, env=slow)
    for rank in range(2):
        assert len(scaled[rank]["hashes"]) == 460
        assert scaled[rank]["hashes"] == static[rank]["hashes"], f"rank {rank}: the pool's changes changed the data"
    counts = [r["count"] for r in readings]
    assert max((r["moves"] for r in readings), default=0) >= 1, "the autoscaler never moved a worker"
    assert counts[0] == 1 and max(counts) == 2, f"the pool should start with one worker and grow to two: {counts}"
    assert 1 in counts[counts.index(2) :], f"the pool never shrank back to one worker: {counts}"
