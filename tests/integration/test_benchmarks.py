"""Each benchmark runs at its smallest size, so the scripts keep working (no figures asserted:
speed and memory goals live in the benchmarks, never in timed tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.jobs import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", f"scripts.{script.removesuffix('.py')}", *args],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_bench_balance_runs():
    out = _run(
        "bench_balance.py",
        *("--steps", "2", "--seqs", "4096,131072", "--dps", "4", "--large-dp", "16", "--large-steps", "1"),
        *("--stepper-steps", "5"),
    )
    assert "least share of the possible improvement" in out and "planner at dp=16" in out
    assert "real Stepper" in out and "--rank-tokens variable" in out
    assert out.count("llama-70b") == 4  # two length mixes x two seq_lens


def test_bench_throughput_runs():
    out = _run(
        "bench_throughput.py",
        *("--steps", "5", "--docs", "300", "--sources", "2", "--seq-len", "256", "--trials", "1", "--mixes", "bpe"),
        *("--ranks", "2", "--workers-per-rank", "1"),
    )
    assert "bpe: omniload / baseline" in out and "single-core speed" in out and "loopback TCP copy" in out
    assert "processes at once" in out  # the reference under the same contention


def test_bench_worker_runs():
    out = _run("bench_worker.py", "--sources", "2", "--docs", "300", "--rounds", "1", "--tokenizer", "bytes")
    assert "worker / tokenizer, 2,000 a call: median" in out


def test_bench_memory_runs():
    out = _run(
        "bench_memory.py",
        "--ranks",
        "1",
        "--sources",
        "2",
        "--docs",
        "300",
        "--kinds",
        "dataloader,omniload",
        "--settle",
        "0",
    )
    assert "DataLoader MB" in out and "omniload at N=1 / at N=1" in out


def test_bench_quality_runs(tmp_path):
    results = tmp_path / "quality.json"
    out = _run(
        "bench_quality.py",
        "--corpus",
        "smoke",
        "--threads",
        "1",
        "--steps",
        "5",
        "--seeds",
        "0",
        "--eval-docs",
        "1",
        "--eval-windows",
        "4",
        "--json",
        str(results),
    )
    assert "omniload - chunks: windows" in out and "omniload-nomask - chunks" in out
    assert "chunks-reshuffled - chunks" in out and "chunks-masked - chunks" in out
    written = json.loads(results.read_text())
    figures = written["results"]
    assert set(figures) == {"windows", "chunks", "omniload", "omniload-nomask", "chunks-reshuffled", "chunks-masked"}
    named = {f["figure"].split(",")[0] for f in written["figures"]}
    assert "noise floor: held-out loss on whole documents" in named, named
    for (arm,) in figures.values():
        assert {"loss_windows", "loss_starts", "loss_documents", "distinct_docs", "top_doc_share"} <= set(arm)


def test_bench_checkpoint_runs():
    out = _run("bench_checkpoint.py", "--steps", "150", "--replays", "0,5", "--large-dp", "16", "--shuffle-fill", "64")
    assert "a step's record" in out and "steps replayed" in out


def test_bench_standby_runs():
    out = _run("bench_standby.py", "--ranks", "2", "--steps", "40", "--kill-at", "15")
    assert "from kill median" in out and "every rank got every step exactly once" in out


def test_bench_fanout_runs_with_lean_consumers():
    out = _run("bench_fanout.py", "--worlds", "4", "--tokens", "1e6", "--modes", "direct", "--procs", "1")
    assert "lean clients" in out and "direct" in out


def test_bench_planner_runs_and_its_batches_do_not_depend_on_the_round_or_the_intake():
    """The same batches through the real rings as from memory: the ring mode times the same work."""
    digests = set()
    for intake in ("memory", "rings"):
        out = _run("bench_planner.py", "--dp", "4", "--steps", "3", "--rounds", "2", "--intake", intake)
        digests |= {line.rsplit(" ", 1)[1] for line in out.splitlines() if "ns a token slot" in line}
    assert len(digests) == 1, out


def test_bench_device_runs_its_three_ways_without_a_gpu():
    """On CPU (--device cpu): the ways' code and the same-batches check, not the GPU figures."""
    out = _run(
        "bench_device.py",
        *("--device", "cpu", "--steps", "3", "--seq-len", "256", "--rows", "2", "--compute-ms", "0", "--docs", "300"),
    )
    assert all(way in out for way in ("plain + .to()", "pin_memory", "device=")) and "the same batches" in out


@pytest.mark.parametrize(
    "tokenizer, cause",
    [("missing-tokenizer.json", "does not exist"), ("tests.transforms_for_tests:exit3", "exited with code 3")],
)
def test_timing_the_tokenizer_in_processes_at_once_says_why_it_failed(tokenizer, cause):
    """bench_throughput's crowded reference: a process that cannot time the tokenizer, by an
    error or by dying, fails the benchmark with the cause instead of leaving it waiting. (In a
    process of its own: spawning starts multiprocessing's resource tracker, which stays.)"""
    call = f"from scripts import bench_data; bench_data.tokens_per_cpu_s_together({tokenizer!r}, 2)"
    result = subprocess.run(
        [sys.executable, "-c", call],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,  # the spawned processes import the test transform from here
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode != 0
    assert "RuntimeError: timing the tokenizer in 2 processes at once failed" in result.stderr
    assert cause in result.stderr


def test_ring_soak_runs_and_finds_no_misread():
    out = _run("ring_soak.py", "--seconds", "2", "--kill-every", "0.25")
    assert "0 misreads, 0 records failing their checks" in out and "writers killed" in out
