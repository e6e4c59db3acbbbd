"""How varied a step is: distinct documents, and the most of it one document holds; pure.

A shuffle that keeps a long document's chunks close fills a step with few documents, and a
step of few documents trains worse (docs/planning.md, Shuffle). These figures ride on every
step (`loader.meta`, `omniload status`, the metrics), measured on the batches as they travel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from omniload.order import CHUNK_BITS


def step_diversity(batches: Sequence[dict[str, NDArray[Any]]], sources: int) -> tuple[int, list[float]]:
    """(distinct documents in the step, per source the largest share of its tokens in the step
    that come from one document; 0.0 for a source with none in it)."""
    if not batches:
        return 0, [0.0] * sources
    source = np.concatenate([b["source"] for b in batches])
    real = source >= 0
    documents = np.concatenate([b["sample_id"] for b in batches])[real] >> CHUNK_BITS  # source and ordinal
    tokens = np.concatenate([np.diff(b["cu_seqlens"]) for b in batches])[real]
    distinct, at = np.unique(documents, return_inverse=True)
    per_document = np.bincount(at, weights=tokens)
    first_of = np.zeros(len(distinct), dtype=np.int64)
    first_of[at] = source[real]  # the source of each distinct document
    top = np.zeros(sources)
    np.maximum.at(top, first_of, per_document)
    totals = np.bincount(source[real], weights=tokens, minlength=sources)
    shares = np.divide(top, totals, out=np.zeros(sources), where=totals > 0)
    return len(distinct), [round(float(s), 4) for s in shares]
