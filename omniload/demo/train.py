"""A tiny GPT-style model trained through omniload; run by `omniload demo` under torchrun (gloo, CPU).

Attention is causal within each packed segment (built from `cu_seqlens`), and positions come
from the batch's `position_ids`, as a varlen-attention model would use them. The loss is the
global batch's mean token loss (`global_batch_loss`), whatever each rank's share of its tokens.
Rank 0 prints per step: that loss, tokens/s, and the share of time the ranks waited for data.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import omniload
from omniload.integrations.document_mask import dense_mask

VOCAB = 256


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """`doc_mask`: attend within each packed document, positions from the batch (as varlen
    attention does); else across a row's documents, positions 0..seq_len-1 (a plain causal GPT)."""

    def __init__(self, seq_len: int, dim: int = 96, layers: int = 2, heads: int = 4, doc_mask: bool = True) -> None:
        super().__init__()
        self.doc_mask = doc_mask
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        rows, seq_len = input_ids.shape
        if not self.doc_mask:  # one segment a row
            cu_seqlens = torch.arange(0, rows * seq_len + 1, seq_len)
            position_ids = torch.arange(seq_len).expand(rows, seq_len)
        x = self.tok(input_ids) + self.pos(position_ids)
        mask = dense_mask(cu_seqlens, rows, seq_len)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def global_batch_loss(logits: torch.Tensor, labels: torch.Tensor, meta: dict[str, Any]) -> torch.Tensor:
    """This rank's part of the global batch's mean token loss, scaled for DDP's gradient average.

    Ranks hold unequal numbers of labelled tokens, so each rank's mean loss weighs tokens
    unequally: sum this rank's token losses and divide by the step's global count
    (`global_trained_tokens`). DDP averages the ranks' gradients, dividing by dp: times dp,
    the averaged gradient is the one of the whole global batch (docs/planning.md)."""
    summed = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100, reduction="sum")
    return summed * (meta["dp"] / max(meta["global_trained_tokens"], 1))  # 0: a step of padding, no loss


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    loader = omniload.connect()
    doc_mask = os.environ.get("OMNILOAD_DEMO_ATTENTION", "document") == "document"
    model = nn.parallel.DistributedDataParallel(TinyGPT(loader.info["seq_len"], doc_mask=doc_mask))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses: list[float] = []
    started = last = time.perf_counter()
    for step, batch in enumerate(loader):
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
        loss = global_batch_loss(logits, batch["labels"], loader.meta)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        figures = torch.tensor([loss.item(), loader.wait_seconds])
        dist.all_reduce(figures)  # the ranks' parts, each times dp, add up to dp x the global mean
        now = time.perf_counter()
        losses.append(figures[0].item() / loader.meta["dp"])
        if rank == 0:
            print(
                f"step {step:3d}  loss {losses[-1]:.3f}  "
                f"tokens/s {loader.meta['global_trained_tokens'] / (now - last):8.0f}  "
                f"data wait {figures[1].item() / world / (now - started):.1%}",
                flush=True,
            )
        last = now
    if rank == 0 and losses:
        k = max(1, len(losses) // 5)
        first, final = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(
            f"demo: {len(losses)} steps, loss {first:.3f} -> {final:.3f} "
            f"({'decreased' if final < first else 'did NOT decrease'})",
            flush=True,
        )
    loader.close()
    del model  # DDP's reducer holds the process group: free it first, or gloo's threads
    gc.collect()  # outlive it and abort the interpreter at exit (SIGABRT, 1 run in 4)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
