"""What a document costs a rank to train on; pure.

`attention`: a*len^2 + b*len + c + d*images per segment, since each segment is its own causal
document. The default coefficients are a transformer layer's FLOPs divided by 2*d_model, for
d_model = 2048: attention 2*d*len^2 -> a = 1, the linear layers 24*d^2*len -> b = 12*d = 24576.
So attention dominates from about 24k tokens up, as in a ~1B-parameter model. --cost-model
derives a, b and d from a model's shape instead (omniload/model_shape.py: training FLOPs). An image costs
the vision encoder: by default d = 256*b, what 256 tokens cost the linear layers (a ViT-L/14 at
224 px runs 256 patches through layers about as wide). `tokens`: len. A user `module:function`
receives a SampleMeta (its `extra` holds `images`) and returns a float (measured costs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniload.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SampleMeta:
    length: int
    source: str
    extra: dict[str, Any] = field(default_factory=dict)


CostFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # (lengths, source indices, images) -> costs


def cost_function(balance: str, coeffs: tuple[float, ...], sources: list[str]) -> CostFn:
    """Resolve --balance into a vectorized cost function; raises ConfigError on a bad name.
    `coeffs`: a,b,c[,d] (without d, images cost nothing)."""
    if balance == "tokens":
        return lambda lengths, _sources, _images: lengths.astype(np.float64)
    if balance == "attention":
        a, b, c, d = (*coeffs, 0.0)[:4]
        return lambda lengths, _sources, images: (a * lengths.astype(np.float64) + b) * lengths + c + d * images
    module, sep, name = balance.partition(":")
    if not sep:
        raise ConfigError(f"balance {balance!r}: expected 'tokens', 'attention' or module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"balance {balance!r}: cannot load it: {exc}") from None

    def user_cost(lengths: np.ndarray, source_idx: np.ndarray, images: np.ndarray) -> np.ndarray:
        return np.array(
            [
                float(fn(SampleMeta(int(n), sources[s], {"images": int(k)})))
                for n, s, k in zip(lengths, source_idx, images)
            ]
        )

    return user_cost
