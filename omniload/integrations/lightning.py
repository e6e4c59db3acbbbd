"""A Lightning DataModule over one omniload Loader per rank; needs pytorch_lightning.

Lightning saves a DataModule's `state_dict()` in every checkpoint and hands it back to
`load_state_dict()` when `fit(ckpt_path=...)` resumes, before the first batch is fetched:
that state is the loader position here. Its fetcher reads one batch ahead of the step it
trains, so the position saved is the one after the last step *trained* (from the trainer's
global step), not after the batch fetched.

Build the Trainer with `use_distributed_sampler=False`: Lightning would otherwise rebuild
a DataLoader with a DistributedSampler, and omniload has already split the data by rank.
When the job's last step has been trained the DataModule stops the Trainer, even if
`max_steps` is further.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
from torch.utils.data import DataLoader

from omniload.integrations.batches import Batch, LoaderDataset, trained_step
from omniload.rank_entry import RankLoader

STATE_KEY = "loader"


class OmniloadDataModule(pl.LightningDataModule):
    """Training batches from `loader` (as `omniload.connect()` returns it), each batch mapped
    by `transform` if given. Every loader batch is one micro-batch."""

    def __init__(self, loader: RankLoader, transform: Callable[[Batch], Batch] | None = None) -> None:
        super().__init__()
        self.loader, self.transform = loader, transform

    def train_dataloader(self) -> DataLoader:
        return DataLoader(LoaderDataset(self.loader, self.transform, on_end=self._stop), batch_size=None)

    def _stop(self) -> None:
        """The job has no more steps: without this, a Trainer with max_steps beyond them would
        start empty epochs forever (max_epochs is unbounded when max_steps is set)."""
        if self.trainer is not None:
            self.trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        """The loader position after the last step trained (read-ahead excluded)."""
        trainer = self.trainer
        if trainer is None:  # not attached to a Trainer: nothing fetched ahead
            return {STATE_KEY: self.loader.state_dict()}
        step = trained_step(trainer.global_step, trainer.accumulate_grad_batches)
        return {STATE_KEY: self.loader.state_dict(step=step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict[STATE_KEY])
