"""torchtitan's data loader contract over an omniload Loader, without importing torchtitan
(so it is tested where torchtitan is not installed); `omniload.integrations.torchtitan` makes
it torchtitan's `BaseDataLoader`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from omniload.integrations.batches import require_whole_rows
from omniload.rank_entry import RankLoader


class TitanBatches:
    """A Loader in torchtitan's data loader contract.

    Iterating yields `({"input": input_ids, "positions": position_ids}, labels)`. state_dict()
    is the loader position after the last batch yielded: torchtitan fetches a step's batches
    just before training it and saves after, never ahead. load_state_dict() must come before
    iterating (torchtitan loads its checkpoint before the first step); an empty state (a
    checkpoint saved without a data loader) leaves the loader at the job's start."""

    def __init__(self, loader: RankLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for i, batch in enumerate(self.loader):
            if i == 0:  # torchtitan shards sequences for its own context parallelism
                require_whole_rows(self.loader, "torchtitan's data loader")
            yield {"input": batch["input_ids"], "positions": batch["position_ids"]}, batch["labels"]

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.loader.load_state_dict(state_dict)
