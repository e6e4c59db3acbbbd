"""A plain PyTorch training loop on omniload, checkpointed with torch.save.

    omniload launch --source "web=data/*.parquet" --seq-len 256 --rows 4 --steps 100 \
        -- torchrun --nproc-per-node 2 examples/plain/train.py --steps 100 --checkpoint-dir ckpt
    # ...stopped? the same command with --resume goes on from the last checkpoint

Where the node has a GPU for every local rank, each rank trains on its own (LOCAL_RANK) with
NCCL and asks the loader for batches already there (`device=`); otherwise on CPU with gloo.

Each rank reads its own batches from the coordinator (no DataLoader, no sampler). The loader's
position is saved with the model and optimizer; loaded before the first batch, it makes the
resumed run see exactly the batches the uninterrupted run would have (docs/recipes.md).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import omniload

VOCAB = 256  # --tokenizer bytes


def tiny_lm(dim: int = 64) -> nn.Module:
    """A next-token model small enough for a CPU: swap in your own."""
    return nn.Sequential(nn.Embedding(VOCAB, dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, VOCAB))


def main() -> None:
    args = parse_args()
    device = torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(tiny_lm().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # on a GPU the batches arrive there, copied from page-locked memory on the current stream
    loader = omniload.connect(device=device if device.type == "cuda" else None)
    checkpoint = Path(args.checkpoint_dir) / "checkpoint.pt"
    if args.resume:  # before the first batch: the loader starts where the checkpoint stopped
        state = torch.load(checkpoint, weights_only=True, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
    for batch in loader:
        step = loader.step  # the job's step number, counted from 0 across resumes
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if args.record:
            record(args.record, rank, step, batch["input_ids"])
        if (step + 1) % args.save_every == 0:
            save(checkpoint, model.module, optimizer, loader.state_dict(), rank)
        if step + 1 >= args.steps:
            break
    loader.close()
    del model  # DDP's reducer holds the process group: free it first, or gloo's threads
    gc.collect()  # outlive it and abort the interpreter at exit (SIGABRT, 1 run in 4)
    dist.destroy_process_group()


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, loader_state: dict, rank: int) -> None:
    """Rank 0 writes the checkpoint (the model is replicated, and the loader position is the
    job's, the same on every rank); the others wait, so no rank runs ahead of a checkpoint."""
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader_state}
        torch.save(state, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # a crash mid-write keeps the previous checkpoint
    dist.barrier()


def record(pattern: str, rank: int, step: int, input_ids: torch.Tensor) -> None:
    """One line per step trained: which batch it was (the tests compare runs with it)."""
    digest = hashlib.blake2b(input_ids.cpu().numpy().tobytes(), digest_size=8).hexdigest()
    with open(pattern.format(rank=rank), "a") as f:
        f.write(json.dumps({"step": step, "digest": digest}) + "\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, required=True, help="train until this many steps in all")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="go on from the checkpoint in --checkpoint-dir")
    parser.add_argument("--record", help="append each step's batch digest to this file ({rank} is replaced)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
