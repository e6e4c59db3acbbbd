"""Lightning on omniload: a LightningDataModule whose state is the loader position.

    omniload launch --source "web=data/*.parquet" --seq-len 256 --rows 4 --steps 100 \
        -- torchrun --nproc-per-node 2 examples/lightning/train.py --steps 100 --checkpoint-dir ckpt
    # ...stopped? the same command with --resume goes on from ckpt/last.ckpt

Lightning runs under torchrun as it is (it reads the torchrun environment); the Trainer is
built with use_distributed_sampler=False, since omniload has already split the data by rank.
OmniloadDataModule (omniload/integrations/lightning.py) puts the loader position in each
Lightning checkpoint and loads it back on fit(ckpt_path=...) (docs/recipes.md).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch import nn

import omniload
from omniload.integrations.lightning import OmniloadDataModule

VOCAB = 256  # --tokenizer bytes


class TinyLM(pl.LightningModule):
    """A next-token model small enough for a CPU: swap in your own."""

    def __init__(self, record: str | None = None, dim: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, VOCAB))
        self.record = record

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.record:  # one line per step trained: which batch it was (the tests compare runs with it)
            digest = hashlib.blake2b(batch["input_ids"].cpu().numpy().tobytes(), digest_size=8).hexdigest()
            with open(self.record.format(rank=self.global_rank), "a") as f:
                f.write(json.dumps({"step": self.global_step, "digest": digest}) + "\n")
        logits = self.net(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    gpus = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    checkpoints = ModelCheckpoint(
        dirpath=args.checkpoint_dir, every_n_train_steps=args.save_every, save_top_k=-1, save_last=True
    )
    trainer = pl.Trainer(
        accelerator="gpu" if gpus else "cpu",
        devices=local,
        num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // local,
        strategy=DDPStrategy(process_group_backend="nccl" if gpus else "gloo"),
        use_distributed_sampler=False,  # omniload's batches are per rank already
        max_steps=args.steps,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = OmniloadDataModule(omniload.connect())
    trainer.fit(TinyLM(args.record), datamodule=data, ckpt_path="last" if args.resume else None)
    del trainer  # its DDP model holds the process group: free it first, or gloo's threads
    gc.collect()  # outlive it and abort the interpreter at exit (SIGABRT, 1 run in 4)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, required=True, help="train until this many steps in all")
    parser.add_argument("--checkpoint-dir", required=True, help="ModelCheckpoint's dirpath")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="go on from the last checkpoint in --checkpoint-dir")
    parser.add_argument("--record", help="append each step's batch digest to this file ({rank} is replaced)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
