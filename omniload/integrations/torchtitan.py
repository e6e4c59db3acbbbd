"""omniload as torchtitan's data loader; needs torchtitan (0.3).

torchtitan builds its data loader from the job config (`config.dataloader.build(dp_rank=...,
dp_world_size=..., tokenizer=..., seq_len=..., local_batch_size=...)`), iterates it for
`(input_dict, labels)` pairs, and saves it in its checkpoint as a `Stateful`.
`OmniloadDataLoader` is that loader over `omniload.connect()`; `TitanBatches`
(titan_batches.py) holds its behaviour without importing torchtitan, so tests check it alone.

torchtitan's labels are the next token at each position, as omniload's are; its models read
`input_dict["input"]` and, for packed rows, `input_dict["positions"]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from omniload.integrations.titan_batches import TitanBatches


class OmniloadDataLoader(TitanBatches, BaseDataLoader):
    """torchtitan's `dataloader` component: name it in the job config (`dataloader=
    OmniloadDataLoader.Config()`). The omniload job decides rows and seq_len; a config that
    asks for others is refused at the first batch, naming both."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        prefetch: int = 4
        """Batches the coordinator may send ahead of the one being trained."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        **kwargs: Any,
    ) -> None:
        import omniload

        # torchtitan's dp rank and degree are its own view of the mesh; omniload reads the
        # global RANK/WORLD_SIZE from torchrun and places ranks by the job's --tp/--pp/--cp
        super().__init__(omniload.connect(prefetch=config.prefetch))
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seq_len, self.local_batch_size = seq_len, local_batch_size

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for inputs, labels in super().__iter__():
            if tuple(labels.shape) != (self.local_batch_size, self.seq_len):
                raise ValueError(
                    f"omniload batches are {tuple(labels.shape)} (rows, seq_len), torchtitan's config asks for "
                    f"({self.local_batch_size}, {self.seq_len}): set training.local_batch_size and "
                    "training.seq_len to the job's --rows and --seq-len"
                )
            yield inputs, labels
