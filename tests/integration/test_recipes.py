"""The trainer recipes under examples/ (docs/recipes.md), each run as a user runs it:
`omniload launch -- torchrun --nproc_per_node=2 examples/<x>/train.py` on CPU (gloo). Each
trains a few steps, checkpoints with its framework's own mechanism, stops, resumes from that
checkpoint, and must train on exactly the batches an uninterrupted job hands each rank, then
end with the job.

A framework that is not installed (the `recipes` extra) skips its test, saying so.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.corpus import make_mixed_corpus, mixed_sources
from tests.jobs import ROOT, TORCHRUN, lockstep_digests, omniload_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS, SAVED_AT, WORLD = 8, 4, 2
_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None  # checked before the job fixtures run


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """The job every recipe runs: small rows, a fixed number of steps."""
    corpus = make_mixed_corpus(tmp_path_factory.mktemp("corpus"))
    return {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "workers": 2, "seed": 5, "steps": STEPS}


@pytest.fixture(scope="module")
def uninterrupted(job) -> list[dict[int, str]]:
    """Per rank, the digest of each step's input_ids when the job runs without a stop."""
    seen = lockstep_digests(job, WORLD)
    assert all(sorted(s) == list(range(STEPS)) for s in seen)
    return seen


RECIPES = [
    pytest.param("plain", None, id="plain"),
    pytest.param("hf_trainer", "transformers", id="hf_trainer"),
    pytest.param("lightning", "pytorch_lightning", id="lightning"),
]


@pytest.mark.parametrize("recipe, framework", RECIPES)
def test_recipe_resumes_from_its_checkpoint_on_the_batches_of_an_uninterrupted_run(
    recipe, framework, job, uninterrupted, tmp_path
):
    if framework:
        pytest.importorskip(framework, reason=f"{framework} is not installed: pip install -e '.[recipes]'")
    _stop_and_resume(ROOT / "examples" / recipe / "train.py", job, uninterrupted, tmp_path)


@pytest.mark.skipif(not _TORCHTITAN, reason="torchtitan is not installed (the torchtitan extra)")
def test_torchtitan_data_loader_resumes_from_dcp_on_the_batches_of_an_uninterrupted_run(job, uninterrupted, tmp_path):
    """examples/torchtitan itself needs an accelerator (torchtitan's Trainer falls back to
    device "cuda", its model registry imports triton); this runs its data loader side on CPU."""
    _stop_and_resume(ROOT / "tests" / "titan_train.py", job, uninterrupted, tmp_path)


def test_torchtitan_recipe_end_to_end():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (the torchtitan extra)")
    pytest.skip(
        "examples/torchtitan needs an accelerator: torchtitan 0.3's Trainer uses device 'cuda' when no "
        "accelerator is found and its Llama 3 registry imports triton; no run of it is tested here"
    )


def _stop_and_resume(script: Path, job: dict, uninterrupted: list[dict[int, str]], tmp_path: Path) -> None:
    """Train SAVED_AT steps checkpointing every SAVED_AT // 2, stop, resume asking for more
    steps than the job has: each rank must train the uninterrupted batches, each once, and
    end with the job."""
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job))
    checkpoints = tmp_path / "checkpoints"

    def train(name: str, *args: str) -> list[dict[int, str]]:
        record = tmp_path / f"{name}-rank{{rank}}.jsonl"
        result = omniload_cli(
            "launch",
            "--config",
            str(config),
            "--",
            *TORCHRUN,
            f"--nproc_per_node={WORLD}",
            str(script),
            "--checkpoint-dir",
            str(checkpoints),
            "--save-every",
            str(SAVED_AT // 2),
            "--record",
            str(record),
            *args,
            timeout=100,
        )
        assert result.returncode == 0, f"{name} run failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        return [_recorded(Path(str(record).format(rank=rank))) for rank in range(WORLD)]

    stopped = train("stopped", "--steps", str(SAVED_AT))
    resumed = train("resumed", "--steps", str(STEPS + 2), "--resume")
    for rank in range(WORLD):
        expected = uninterrupted[rank]
        assert stopped[rank] == {s: expected[s] for s in range(SAVED_AT)}, f"rank {rank} before the stop"
        assert sorted(resumed[rank]) == list(range(SAVED_AT, STEPS)), f"rank {rank}: steps trained after resume"
        assert resumed[rank] == {s: expected[s] for s in range(SAVED_AT, STEPS)}, f"rank {rank}: batches after resume"


def _recorded(path: Path) -> dict[int, str]:
    """step -> digest, as a recipe's --record wrote them; a step trained twice would show."""
    steps: dict[int, str] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        assert entry["step"] not in steps, f"{path.name}: step {entry['step']} trained twice"
        steps[entry["step"]] = entry["digest"]
    return steps
