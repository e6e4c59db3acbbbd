"""See inside a running job: `omniload status`, the Prometheus endpoint, launch's progress line."""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import omniload
from tests.corpus import mixed_sources, source_flags
from tests.jobs import PROBE, collect, omniload_cli, start_ranks, wait_for_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _spec(corpus) -> dict:
    return {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "rows": 2,
        "workers": 3,
        "epochs": 0,
        "steps": 500,  # 10 s of steps at PROBE_STEP_S 0.02: the job outlasts the test's scrapes and CLI calls
        "metrics_port": 0,
        "shuffle_window": 32,
    }  # small windows: sources are read all along


def _scrape(job: omniload.Job) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{job.metrics_addr}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_status_and_metrics_list_every_source_and_rank_and_their_counters_grow(corpus, tmp_path):
    with omniload.Job(_spec(corpus)) as job:
        ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.02"})
        at = wait_for_status(job, lambda s: s["steps"]["slowest"] >= 10, "10 steps consumed")["steps"]["slowest"]
        first, status = _scrape(job), job.status()
        wait_for_status(job, lambda s: s["steps"]["slowest"] >= at + 10, "10 more steps consumed")
        second = _scrape(job)
        table = omniload_cli("status", "--once", env=job.env())
        as_json = json.loads(omniload_cli("status", "--json", "--addr", job.addr, "--token", job.token).stdout)
        collect(ranks)
    names = [s["name"] for s in mixed_sources(corpus)]
    assert [s["name"] for s in status["sources"]] == names
    assert sorted(r["rank"] for r in status["ranks"]) == [0, 1]
    assert all(s["docs"] > 0 and s["tokens"] > 0 and 0 <= s["ring_fill"] <= 1 for s in status["sources"])
    assert status["planner"]["steps"] > 0 and set(status["planner"]["weights"]) == set(names)
    assert {s["name"] for s in as_json["sources"]} == set(names) and len(as_json["ranks"]) == 2
    assert table.returncode == 0, table.stderr
    for word in (*names, "docs/s", "tokens/s", "ring", "rank", "wait%", "planner:", "ms/step", "memory: coordinator"):
        assert word in table.stdout, word
    memory = status["memory_mb"]  # the coordinator reports its own heap and the rings' read-ahead
    assert 0 < memory["coordinator_heap"] < memory["coordinator_pss"] <= memory["coordinator"] + 1, memory
    assert memory["rings"] > 0 and memory["workers"] > 0, memory
    read = [[run[("omniload_source_tokens_total", (("source", name),))] for name in names] for run in (first, second)]
    assert all(tokens > 0 for tokens in read[0]) and sum(read[1]) > sum(read[0]), read  # windows are read in bursts
    for rank in ("0", "1"):
        assert (
            second[("omniload_rank_steps_consumed", (("rank", rank),))]
            > first[("omniload_rank_steps_consumed", (("rank", rank),))]
        )
    assert second[("omniload_planner_steps_total", ())] > first[("omniload_planner_steps_total", ())]
    assert second[("omniload_delivered_tokens_total", ())] > first[("omniload_delivered_tokens_total", ())] > 0
    assert ("omniload_mixture_weight", (("source", names[0]),)) in second


def test_launch_prints_progress_lines_and_q_silences_them(corpus, tmp_path):
    flags = source_flags(mixed_sources(corpus))
    common = [*flags, "--seq-len", "64", "--workers", "3", "--steps", "60"]
    rank = [sys.executable, str(PROBE), str(tmp_path / "out.json")]
    talkative = omniload_cli(
        "launch", *common, "--progress-every", "0.5", "--", *rank, env={"PROBE_STEP_S": "0.05"}, timeout=90
    )
    quiet = omniload_cli(
        "launch", *common, "--progress-every", "0.5", "-q", "--", *rank, env={"PROBE_STEP_S": "0.05"}, timeout=90
    )
    assert talkative.returncode == 0 and quiet.returncode == 0, talkative.stderr + quiet.stderr
    lines = [line for line in talkative.stderr.splitlines() if "tokens/s" in line]
    assert len(lines) >= 2, talkative.stderr
    assert all(line.startswith("omniload: step ") and "ranks wait" in line and "ms/step" in line for line in lines), (
        lines
    )
    assert any("slowest rank 0" in line and " 0 tokens/s" not in line for line in lines), lines
    assert "tokens/s" not in quiet.stderr
