"""Exact checkpoint and resume (docs/architecture.md, Invariants: deterministic, exactly once):
kill -9, elastic, changed data, DCP."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from collections import Counter
from pathlib import Path

import psutil
import pytest

import omniload
from omniload.coordinator.checkpoint.folder import last_position
from tests.corpus import documents, mixed_sources, write_parquet
from tests.jobs import (
    ROOT,
    collect,
    lockstep_digests,
    omniload_cli,
    run_as_torchrun,
    run_ranks,
    start_ranks,
    wait_for_checkpoint,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_sigkill_then_resume_from_the_folder_repeats_the_uninterrupted_run(corpus, tmp_path):
    spec = {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "rows": 2,
        "workers": 3,
        "seed": 4,
        "epochs": 0,
        "steps": 120,
    }
    reference = run_ranks(spec, world=2, out_dir=tmp_path)
    folder = tmp_path / "ckpt"
    target = random.Random(os.getpid()).randint(41, 90)
    job = omniload.Job({**spec, "checkpoint_dir": str(folder), "snapshot_every": 25}).start()
    ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.03"})
    wait_for_checkpoint(folder, target)
    victims = [psutil.Process(job._process.pid), *(psutil.Process(p.pid) for p, _ in ranks)]
    for victim in victims:
        victim.send_signal(signal.SIGKILL)
    for process, _ in ranks:
        process.wait()
    job.wait(10)
    job.stop()  # what the launcher does: remove what the dead coordinator could not

    with omniload.Job({**spec, "resume": str(folder)}) as resumed_job:
        resumed = collect(start_ranks(resumed_job, 2, tmp_path))
        log = "\n".join(resumed_job.log_tail())
    start = resumed[0]["steps"][0]
    assert start >= target and f"resuming from {folder} at step {start}" in log
    for rank in range(2):
        assert resumed[rank]["steps"] == list(range(start, 120))
        assert resumed[rank]["hashes"] == reference[rank]["hashes"][start:], f"rank {rank} differs after resume"


@pytest.mark.parametrize("before, after", [(4, 2)])  # more ranks after: test_images' resume on 3 after 2 (suite time)
def test_resume_with_a_different_number_of_ranks_delivers_every_sample_once(corpus, tmp_path, before, after):
    spec = {"sources": mixed_sources(corpus), "seq_len": 256, "rows": 2, "workers": 3, "seed": 8, "epochs": 1}
    whole = Counter(i for rank in run_ranks(spec, world=before, out_dir=tmp_path) for i in rank["sample_ids"])
    folder = tmp_path / f"ckpt{before}{after}"
    with omniload.Job({**spec, "checkpoint_dir": str(folder)}) as job:
        first = collect(start_ranks(job, before, tmp_path, max_steps=15))
        assert wait_for_checkpoint(folder, 15, timeout=10) == 15
    found = last_position(folder)
    assert found.replay == 14 and any(s is not None for s in found.state["spreads"].values())
    with omniload.Job({**spec, "resume": str(folder)}) as job:
        second = collect(start_ranks(job, after, tmp_path))
    delivered = Counter(i for rank in first + second for i in rank["sample_ids"])
    assert not [i for i, n in delivered.items() if n > 1], "a sample was delivered twice"
    assert delivered == whole, f"lost {sum((whole - delivered).values())} samples"


def test_changed_spec_or_files_are_refused_naming_what_changed(corpus, tmp_path):
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "workers": 3, "steps": 8}
    folder = tmp_path / "ckpt"
    run_ranks({**spec, "checkpoint_dir": str(folder)}, world=1, out_dir=tmp_path)
    with pytest.raises(omniload.ConfigError, match="spec seq_len: checkpoint 64, job 96"):
        omniload.Job({**spec, "seq_len": 96, "resume": str(folder)}).start()
    write_parquet(Path(corpus["web"]).parent / "b.parquet", documents(210, 2))
    with pytest.raises(omniload.ConfigError, match="source 'web': .*b.parquet changed"):
        omniload.Job({**spec, "resume": str(folder)}).start()
    result = omniload_cli(
        "launch", "--config", _config(tmp_path, spec), "--resume", str(folder), "--", sys.executable, "-c", "pass"
    )
    assert result.returncode == 2 and "b.parquet changed" in result.stderr and "--allow-changed-data" in result.stderr
    allowed = run_ranks({**spec, "resume": str(folder), "allow_changed_data": True, "steps": 12}, 1, tmp_path)
    assert allowed[0]["steps"][0] == 8
    recorded = b"".join(p.read_bytes() for p in [*folder.glob("deltas-*.log"), *folder.glob("snapshot-*.json")])
    assert b"allow_changed_data: resumed at step 8 over changed data" in recorded


def _config(tmp_path: Path, spec: dict) -> str:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    return str(path)


def test_loader_state_saved_and_loaded_with_torch_distributed_checkpoint(corpus, tmp_path):
    """Two ranks in torchrun's environment save the loader with the model through
    torch.distributed.checkpoint, and two ranks of a new job load it (tests/dcp_train.py)."""
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "steps": 20, "epochs": 0}

    def run_dcp_ranks(mode: str, out: str) -> dict[int, dict]:
        with omniload.Job(spec) as job:
            run_as_torchrun(job, 2, ROOT / "tests" / "dcp_train.py", mode, str(tmp_path / "dcp"), str(tmp_path / out))
        return {r: json.loads((tmp_path / out.format(rank=r)).read_text()) for r in range(2)}

    full = lockstep_digests(spec, world=2, digest_size=16)  # the job uninterrupted
    saved = run_dcp_ranks("save", "save{rank}.json")
    loaded = run_dcp_ranks("load", "load{rank}.json")
    for rank in range(2):
        assert sorted(map(int, saved[rank])) == list(range(10))
        assert sorted(map(int, loaded[rank])) == list(range(10, 20))
        assert {int(s): h for s, h in {**saved[rank], **loaded[rank]}.items()} == full[rank]
