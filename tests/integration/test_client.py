"""The rank client in a real trainer: the position of an earlier step (a trainer that fetches
the next batch before it saves, also through --broadcast-at tp), pinned memory, the end of the
data."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

import omniload
from omniload import client
from omniload.state import RANK_KEY
from tests.corpus import mixed_sources
from tests.jobs import ROOT, run_as_torchrun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS = 30
TRAINER = ROOT / "tests" / "prefetch_train.py"
NO_CUDA = "no CUDA here: the CPU-only behaviour is tested instead"


def _spec(corpus: dict, **extra) -> dict:
    return {
        "sources": mixed_sources(corpus),
        "seq_len": 64,
        "rows": 2,
        "workers": 2,
        "seed": 5,
        "epochs": 0,
        "steps": STEPS,
        **extra,
    }


def _digest(batch: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(batch):
        h.update(name.encode() + batch[name].cpu().numpy().tobytes())
    return h.hexdigest()


def _connect(job: omniload.Job, **kwargs) -> client.Loader:
    return omniload.connect(job.addr, job.token, rank=0, world_size=1, **kwargs)


def _run(spec: dict, **kwargs) -> dict[int, str]:
    """Every batch of a fresh job, as {step: digest}."""
    with omniload.Job(spec) as job, _connect(job, **kwargs) as loader:
        return {loader.step: _digest(batch) for batch in loader}  # noqa: B035  (step moves on with each batch)


def _step_of(state: dict[str, str]) -> int:
    return json.loads(state[RANK_KEY])["step"]


def test_the_position_of_the_trained_step_resumes_a_prefetching_trainer_bit_exact(corpus):
    trained_at, trained = 12, {}
    with omniload.Job(_spec(corpus)) as job, _connect(job) as loader:
        assert loader.step is None
        it = iter(loader)
        batch = next(it, None)
        while batch is not None:
            step = loader.step
            trained[step] = _digest(batch)
            batch = next(it, None)  # the next batch is fetched before the checkpoint is saved
            if step == trained_at:
                assert loader.step == trained_at + 1
                saved = loader.state_dict(step=step)
                assert saved == loader.position(step) and _step_of(saved) == trained_at + 1
                assert loader.state_dict() == loader.position(trained_at + 1) != saved
    assert sorted(trained) == list(range(STEPS))

    with omniload.Job(_spec(corpus)) as job, _connect(job) as loader:
        loader.load_state_dict(saved)
        assert loader.position(trained_at) == saved  # the state loaded, kept before connecting
        resumed = {loader.step: _digest(batch) for batch in loader}  # noqa: B035  (step moves on with each batch)
    assert sorted(resumed) == list(range(trained_at + 1, STEPS)), (
        "the resumed run does not start after the trained step"
    )
    assert resumed == {s: h for s, h in trained.items() if s > trained_at}, "the resumed batches differ"


def test_a_step_not_kept_raises_naming_the_steps_that_can_be_asked_for(corpus):
    with omniload.Job(_spec(corpus)) as job, _connect(job) as loader:
        with pytest.raises(omniload.OmniloadError, match="has not connected yet"):
            loader.position(-1)
        assert json.loads(loader.state_dict()[RANK_KEY]) is None  # the job's start, without connecting
        assert loader.info["resume_step"] == 0
        start = loader.position(-1)
        assert start == loader.state_dict(step=-1) == loader.state_dict() and _step_of(start) == 0
        with pytest.raises(
            omniload.OmniloadError, match="step 0 has not been handed out yet: ask for a step from -1 to -1"
        ):
            loader.position(0)
        for _ in loader:
            pass
        assert loader.step == STEPS - 1
        first = STEPS - client.KEPT_POSITIONS
        for step in (first - 1, -1):
            with pytest.raises(
                omniload.OmniloadError, match=f"step {step} is too old: ask for a step from {first} to {STEPS - 1}"
            ):
                loader.state_dict(step=step)
        with pytest.raises(
            omniload.OmniloadError,
            match=f"step {STEPS} has not been handed out yet: ask for a step from {first} to {STEPS - 1}",
        ):
            loader.position(STEPS)
        with pytest.raises(TypeError, match="step must be an int"):
            loader.position("3")
        assert [_step_of(loader.position(s)) for s in range(first, STEPS)] == list(range(first + 1, STEPS + 1))
        assert loader.position(STEPS - 1) == loader.state_dict()


def test_a_loop_ends_at_the_end_of_the_data_and_stays_ended(corpus):
    with omniload.Job(_spec(corpus, steps=5)) as job, _connect(job) as loader:
        assert [loader.step for _ in loader] == [0, 1, 2, 3, 4]
        with pytest.raises(StopIteration):
            next(loader)
        assert loader.position(4) == loader.state_dict()  # the positions outlive the end


def test_prefetching_tp_ranks_save_the_trained_step_and_resume_bit_exact(corpus, tmp_path):
    """--broadcast-at tp: position() and state_dict(step=) are collective (rank 1 connects to no
    coordinator), and an out-of-range step raises on every rank."""
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 2, "steps": 14, "epochs": 0}
    spec |= {"tp": 2, "broadcast_at": "tp"}

    def run_trainer_ranks(mode: str) -> list[dict]:
        with omniload.Job(spec) as job:
            run_as_torchrun(
                job, 2, TRAINER, mode, str(tmp_path / "state{rank}.json"), str(tmp_path / f"{mode}{{rank}}.json")
            )
        return [json.loads((tmp_path / f"{mode}{r}.json").read_text()) for r in range(2)]

    saved = run_trainer_ranks("save")
    loaded = run_trainer_ranks("load")
    states = [json.loads((tmp_path / f"state{r}.json").read_text()) for r in range(2)]
    assert states[0] == states[1] and _step_of(states[0]) == 7  # SAVE_AT + 1
    for rank in range(2):
        assert sorted(map(int, saved[rank]["trained"])) == list(range(14))
        assert "step 8 has not been handed out yet" in saved[rank]["error"], f"rank {rank}: {saved[rank]['error']}"
        assert loaded[rank]["trained"] == {s: h for s, h in saved[rank]["trained"].items() if int(s) > 6}
    assert saved[0]["trained"] == saved[1]["trained"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the pinned tests below run instead")
def test_pin_memory_without_cuda_warns_and_hands_out_the_same_cpu_batches(corpus):
    plain = _run(_spec(corpus, steps=8))
    with pytest.warns(UserWarning, match=r"pin_memory=True\): CUDA is not available"):
        pinned = _run(_spec(corpus, steps=8), pin_memory=True)
    assert pinned == plain
    with pytest.raises(omniload.ConfigError, match="CUDA is not available"):
        omniload.connect("127.0.0.1:1", "token", rank=0, world_size=1, device="cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the warning is not given")
def test_the_no_cuda_warning_is_given_once_per_process():
    code = (
        "import omniload\n"
        "for _ in range(3):\n"
        "    omniload.connect('127.0.0.1:1', 't', rank=0, world_size=1, pin_memory=True)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("CUDA is not available") == 1, result.stderr


def test_the_page_locked_receive_path_hands_out_the_same_batches(corpus, monkeypatch):
    """The receive thread reads each batch into one buffer, and the labels and positions derived
    from it go to others: every tensor lives in page-locked memory (where CUDA is; here an
    ordinary tensor stands in for it, so the path runs on CPU)."""
    plain = _run(_spec(corpus, steps=8))
    buffers = []

    def page_locked(size: int) -> torch.Tensor:
        buffers.append(torch.empty(size, dtype=torch.uint8))
        return buffers[-1]

    monkeypatch.setattr(client, "_page_locked", page_locked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    with omniload.Job(_spec(corpus, steps=8)) as job, _connect(job, pin_memory=True) as loader:
        assert loader.pin_memory
        seen = {}
        for batch in loader:
            seen[loader.step] = _digest(batch)
            storages = {t.untyped_storage().data_ptr() for t in batch.values() if t.numel()}
            locked = {b.untyped_storage().data_ptr() for b in list(buffers)}  # kept: never reused
            assert storages <= locked, "a tensor is not in page-locked memory"
    assert seen == plain
    assert len(buffers) == 8 * 5  # a batch: the receive buffer, input_ids, labels, positions, source


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_pinned_batches_are_page_locked_and_device_batches_on_the_gpu(corpus):
    plain = _run(_spec(corpus, steps=8))
    with omniload.Job(_spec(corpus, steps=8)) as job, _connect(job, pin_memory=True) as loader:
        pinned = {}
        for batch in loader:
            assert all(t.is_pinned() for t in batch.values() if t.numel()), "a tensor is not page-locked"
            pinned[loader.step] = _digest(batch)
    assert pinned == plain
    with omniload.Job(_spec(corpus, steps=8)) as job, _connect(job, device="cuda") as loader:
        on_gpu = {}
        for batch in loader:
            assert all(t.device.type == "cuda" for t in batch.values())
            on_gpu[loader.step] = _digest(batch)
    assert on_gpu == plain
