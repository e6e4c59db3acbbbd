"""Framework-neutral pieces of the trainer integrations (torch only, no trainer imported).

A trainer saves its checkpoint after an optimizer step, but it may have fetched the next batch
already (Lightning does, to know whether the epoch ends; accelerate's loaders do too). The
loader position to save is the one after the last batch *trained on*, which the trainer knows
by its step count, not the loader: `trained_step` turns the one into the other, and
`Loader.state_dict(step=...)` gives that position (docs/checkpoint.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from omniload.batch_arrays import IGNORE_INDEX
from omniload.errors import ConfigError

Batch = dict[str, torch.Tensor]


def require_whole_rows(loader: Any, who: str) -> None:
    """Refuse a job with context parallelism once `loader` is connected: `who` shifts labels
    or shards sequences itself, which assumes whole rows, while a cp rank holds pieces of them."""
    cp = getattr(loader, "info", {}).get("layout", {}).get("cp", 1)
    if cp > 1:
        raise ConfigError(
            f"{who} takes whole rows, but the job has --cp {cp}: each rank holds pieces of its "
            "sequences. Run it with --cp 1, or feed a model built for context parallelism from a plain loop"
        )


class LoaderDataset(IterableDataset):
    """The batches of one rank's Loader as a torch IterableDataset; wrap it in
    `DataLoader(dataset, batch_size=None)`: the batches are whole already.

    It holds no state of its own and has no state_dict(), on purpose: a framework that saves
    the state of any iterable that has one (Lightning's CombinedLoader does) would save the
    position after the batch it prefetched, one step ahead of the model. The position is saved
    by the integration, from the step the trainer trained on.

    `transform` maps each batch (to rename keys, drop some, convert labels) before it is yielded.
    `on_end` is called when the loader has no more batches (the job's last step was handed
    out): a trainer that would start another, empty, epoch can be told to stop there.
    `whole_rows_for`, when given, names a framework that needs whole rows (require_whole_rows).
    """

    def __init__(
        self,
        loader: Iterable[Batch],
        transform: Callable[[Batch], Batch] | None = None,
        on_end: Callable[[], None] | None = None,
        whole_rows_for: str | None = None,
    ) -> None:
        super().__init__()
        self.loader, self.transform, self.on_end = loader, transform, on_end
        self.whole_rows_for = whole_rows_for

    def __iter__(self) -> Iterator[Batch]:
        for i, batch in enumerate(self.loader):
            if i == 0 and self.whole_rows_for:  # connected now: the job's layout is known
                require_whole_rows(self.loader, self.whole_rows_for)
            yield batch if self.transform is None else self.transform(batch)
        if self.on_end is not None:
            self.on_end()


def trained_step(optimizer_steps: int, batches_per_step: int = 1) -> int:
    """The loader step of the last batch trained on after `optimizer_steps` optimizer steps of
    `batches_per_step` batches each (gradient accumulation), counting the job's steps from 0;
    -1 before the first, whose position is the job's start.

    Holds when every loader batch is one micro-batch and the trainer's step count started with
    the job (a resumed trainer restores both, so it keeps holding)."""
    if optimizer_steps < 0 or batches_per_step < 1:
        raise ValueError(
            f"optimizer_steps must be >= 0 and batches_per_step >= 1, got {optimizer_steps} and {batches_per_step}"
        )
    return optimizer_steps * batches_per_step - 1


def unshifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """omniload's labels (`labels[i]` is the token after position i, or -100) in the Hugging
    Face convention, where a causal LM shifts them itself (`labels[i]` is the token *at* i).

    Exact: a row's last label is always -100 (a segment ends there), so the shift the model
    does drops nothing, and the -100 at a segment's first token keeps a document from being
    trained to continue the one packed before it."""
    first = torch.full_like(labels[..., :1], IGNORE_INDEX)
    return torch.cat([first, labels[..., :-1]], dim=-1)
