"""The Hugging Face Trainer reading one omniload Loader per rank; needs transformers.

Two things a Trainer does by default are wrong for omniload, and `OmniloadTrainer` turns
them off:

- accelerate re-shards the training data: with an IterableDataset it reads on one process
  and dispatches (`dispatch_batches`), or has every process read everything and keep a slice
  of it (`IterableDatasetShard`). omniload has already given each rank its own batches, so
  `get_train_dataloader` returns a plain DataLoader that accelerate never prepares.
- on resume it skips as many batches as were trained (`ignore_data_skip=False`), which would
  skip them a second time: the loader resumes at its saved position. OmniloadTrainer refuses
  arguments without `ignore_data_skip=True`.

The loader position goes into each `checkpoint-N` folder the Trainer writes (one small JSON
file per rank, `omniload-loader-rank{R}.json`, by `LoaderCheckpoint.on_save`) and is loaded
back by `train(resume_from_checkpoint=...)` before the first batch is fetched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from omniload.errors import ConfigError
from omniload.integrations.batches import Batch, LoaderDataset, trained_step, unshifted_labels
from omniload.rank_entry import RankLoader

STATE_FILE = "omniload-loader-rank{rank}.json"
MODEL_INPUTS = ("input_ids", "position_ids")  # what a causal LM's forward takes from a batch


def causal_lm_inputs(batch: Batch) -> Batch:
    """A batch as a transformers causal LM's forward takes it: its labels unshifted (the model
    shifts them), the packing metadata (`cu_seqlens`, `source`, `sample_id`) left out."""
    return {**{key: batch[key] for key in MODEL_INPUTS}, "labels": unshifted_labels(batch["labels"])}


class LoaderCheckpoint(TrainerCallback):
    """Writes the loader position of the step just trained into the checkpoint folder the
    Trainer has just written, one file per rank."""

    def __init__(self, loader: RankLoader, rank: int) -> None:
        self.loader, self.rank = loader, rank

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        step = trained_step(state.global_step, args.gradient_accumulation_steps)
        save_loader_state(self.loader.state_dict(step=step), folder, self.rank)


class OmniloadTrainer(Trainer):
    """A Trainer whose training data is `loader`, this rank's batches as they come.

    Pass `train_dataset=None`; the arguments must say `ignore_data_skip=True` and
    `max_steps` (the loader has no length). Every loader batch is one micro-batch."""

    def __init__(self, *args: Any, loader: RankLoader, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.args.ignore_data_skip:
            raise ConfigError(
                "OmniloadTrainer needs TrainingArguments(ignore_data_skip=True): on resume the loader "
                "starts at its saved position, and skipping the trained batches again would lose them"
            )
        self.loader = loader
        self.add_callback(LoaderCheckpoint(loader, self.args.process_index))

    def get_train_dataloader(self) -> DataLoader:
        """This rank's batches, not passed through accelerator.prepare (which would re-shard them)."""
        dataset = LoaderDataset(
            self.loader, causal_lm_inputs, whole_rows_for="OmniloadTrainer (its labels are shifted)"
        )
        return DataLoader(dataset, batch_size=None)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """As Trainer.train; resuming also restores the loader position from that checkpoint
        (`True`: the last checkpoint in output_dir, as Trainer resolves it)."""
        folder: str | None = None
        if resume_from_checkpoint is True:
            folder = get_last_checkpoint(self.args.output_dir)
            if folder is None:
                raise ConfigError(f"resume_from_checkpoint=True, but {self.args.output_dir} holds no checkpoint")
        elif resume_from_checkpoint:
            folder = str(resume_from_checkpoint)
        if folder is not None:
            self.loader.load_state_dict(load_loader_state(folder, self.args.process_index))
        return super().train(folder, *args, **kwargs)


def save_loader_state(state: dict[str, str], folder: str | os.PathLike, rank: int) -> Path:
    """Write one rank's loader state into a checkpoint folder; the file written."""
    path = Path(folder) / STATE_FILE.format(rank=rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(state))
    temporary.replace(path)  # a crash mid-write leaves the old file or none, never half of one
    return path


def load_loader_state(folder: str | os.PathLike, rank: int) -> dict[str, str]:
    """One rank's loader state from a checkpoint folder that save_loader_state wrote into.

    The position is the job's, the same on every rank: a rank the saving run did not have
    (a resume on more ranks) reads rank 0's."""
    path = Path(folder) / STATE_FILE.format(rank=rank)
    if not path.is_file():
        path = Path(folder) / STATE_FILE.format(rank=0)
    if not path.is_file():
        raise ConfigError(
            f"checkpoint {folder} has no loader state for rank {rank} ({path.name}): was it written by "
            "OmniloadTrainer? Without it the run would start the data from the beginning"
        )
    state: dict[str, str] = json.loads(path.read_text())
    return state
