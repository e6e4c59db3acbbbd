"""A torchrun rank for the loss-normalisation test: the demo's gradient against the global batch's.

Usage: python tests/loss_scale_probe.py OUT_DIR STEPS   (under torchrun, or in its environment:
tests/jobs.run_as_torchrun).
Every rank runs the demo's model under DDP with the demo's loss (omniload/demo/train.py) for
STEPS batches without stepping the optimizer, and gathers every rank's batch. Rank 0 also runs
an unwrapped copy of the same model on the gathered global batch, with the plain mean token
loss, and on each rank's batch with the per-rank mean averaged over ranks (the usual mistake).
It writes OUT_DIR/grads.npz ("{step}/ddp", "{step}/global", "{step}/naive": the flattened
gradients) and OUT_DIR/counts.json (per step: the meta's global_trained_tokens on each rank
and each rank's count of labels != -100).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import omniload
from omniload.demo.train import VOCAB, TinyGPT, global_batch_loss

KEYS = ("input_ids", "position_ids", "cu_seqlens", "labels")


def _grad(model: nn.Module) -> np.ndarray:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()


def _mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    return F.cross_entropy(logits.view(-1, VOCAB), batch["labels"].view(-1), ignore_index=-100)


def _joined(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ranks' rows as one batch: rows stacked, segment bounds run on."""
    cu, offset = [batches[0]["cu_seqlens"][:1]], 0
    for b in batches:
        cu.append(b["cu_seqlens"][1:] + offset)
        offset += b["input_ids"].numel()
    joined = {name: torch.cat([b[name] for b in batches]) for name in ("input_ids", "position_ids", "labels")}
    return {**joined, "cu_seqlens": torch.cat(cu)}


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    loader = omniload.connect()
    model = TinyGPT(loader.info["seq_len"])
    reference = copy.deepcopy(model)  # the same weights, outside DDP
    ddp = nn.parallel.DistributedDataParallel(model)
    grads, counts = {}, []
    for step, batch in zip(range(steps), loader):
        logits = ddp(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
        ddp.zero_grad(set_to_none=True)
        global_batch_loss(logits, batch["labels"], loader.meta).backward()
        gathered: list[dict | None] = [None] * world
        dist.all_gather_object(gathered, {name: batch[name] for name in KEYS})
        labelled = [int((b["labels"] != -100).sum()) for b in gathered]
        metas: list[int | None] = [None] * world
        dist.all_gather_object(metas, loader.meta["global_trained_tokens"])
        if rank == 0:
            grads[f"{step}/ddp"] = _grad(ddp.module)
            reference.zero_grad(set_to_none=True)
            _mean_loss(reference, _joined(gathered)).backward()
            grads[f"{step}/global"] = _grad(reference)
            reference.zero_grad(set_to_none=True)
            (sum(_mean_loss(reference, b) for b in gathered) / world).backward()
            grads[f"{step}/naive"] = _grad(reference)
            counts.append({"meta": metas, "labelled": labelled})
    loader.close()
    del ddp  # DDP's reducer holds the process group: free it first (omniload/demo/train.py)
    gc.collect()
    dist.destroy_process_group()
    if rank == 0:
        np.savez(os.path.join(out, "grads.npz"), **grads)
        with open(os.path.join(out, "counts.json"), "w") as f:
            json.dump(counts, f)


if __name__ == "__main__":
    main()
