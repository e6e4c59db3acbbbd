"""OmniloadTrainer's refusals and its checkpoint file (omniload.integrations.hf), without a job:
the loader is never iterated. The training itself is tests/integration/test_recipes.py."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[recipes]'")

from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

from omniload.client import Loader  # noqa: E402
from omniload.errors import ConfigError  # noqa: E402
from omniload.integrations.hf import OmniloadTrainer, load_loader_state, save_loader_state  # noqa: E402


def _trainer(tmp_path, **arguments) -> OmniloadTrainer:
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    )
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, use_cpu=True, report_to="none", **arguments)
    return OmniloadTrainer(model=model, args=args, loader=Loader("127.0.0.1:9", "token", 0, 1, 1))


def test_a_trainer_that_would_skip_the_trained_batches_again_on_resume_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="ignore_data_skip=True"):
        _trainer(tmp_path)


def test_resuming_from_a_folder_without_checkpoints_says_so(tmp_path):
    trainer = _trainer(tmp_path, ignore_data_skip=True)
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        trainer.train(resume_from_checkpoint=True)


def test_a_checkpoint_without_the_loader_state_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="no loader state for rank 1 .*start the data from the beginning"):
        load_loader_state(tmp_path, rank=1)


def test_the_loader_state_round_trips_and_a_rank_the_saving_run_had_not_reads_rank_0s(tmp_path):
    state = {"omniload_loader_state": '{"step": 4}'}
    save_loader_state(state, tmp_path / "checkpoint-4", rank=0)
    assert load_loader_state(tmp_path / "checkpoint-4", rank=0) == state
    assert load_loader_state(tmp_path / "checkpoint-4", rank=3) == state  # the position is the job's
