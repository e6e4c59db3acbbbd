"""Attention within each packed document, from the batch's `cu_seqlens` (torch only).

A row packs several documents; `cu_seqlens` marks where each segment starts in the batch's
tokens read row by row (a row's padding is a segment of its own), and `position_ids` restart
at every document. A model that attends across a row's documents sees the end of one document
as context for the next; these give the mask that keeps each token to its own document, for
FlexAttention (`flex_block_mask`) or as a dense boolean mask (`dense_mask`, for
`scaled_dot_product_attention` on small models). Varlen kernels (flash-attn's
`flash_attn_varlen_func`, Transformer Engine's THD layout) take `cu_seqlens` as it is
(docs/recipes.md, "A document mask").
"""

from __future__ import annotations

from typing import Any

import torch


def document_ids(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """The segment of each of the batch's `tokens` tokens, read row by row (int64 [tokens])."""
    positions = torch.arange(tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens.to(torch.int64), positions, right=True) - 1


def dense_mask(cu_seqlens: torch.Tensor, rows: int, seq_len: int) -> torch.Tensor:
    """bool [rows, seq_len, seq_len]: position i of a row may attend to j iff j <= i and both
    are in the same document."""
    segment = document_ids(cu_seqlens, rows * seq_len).view(rows, seq_len)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=cu_seqlens.device).tril()
    return (segment.unsqueeze(2) == segment.unsqueeze(1)) & causal


def flex_block_mask(batch: dict[str, torch.Tensor]) -> Any:
    """A FlexAttention BlockMask for `batch` (input_ids [rows, seq_len], cu_seqlens): rows as
    the batch dimension, causal within each document. Pass it as flex_attention's `block_mask`
    with queries of shape [rows, heads, seq_len, head_dim]."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, seq_len = batch["input_ids"].shape
    segment = document_ids(batch["cu_seqlens"], rows * seq_len).view(rows, seq_len)

    def same_document_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (segment[b, q] == segment[b, kv]) & (q >= kv)

    return create_block_mask(same_document_causal, rows, None, seq_len, seq_len, device=str(segment.device))
