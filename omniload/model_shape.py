"""A model's shape and what a document costs to train it on: the --cost-model coefficients; pure.

A causal decoder (Llama's layout: grouped-query attention, a gated MLP of three matrices, an
untied output head) trained with document masking, so every segment is its own causal
sequence. Training FLOPs of one segment of L tokens, forward plus backward (3x the forward):

    linear, per token:   P = 2 * (layers * (h*(h + 2*kv) + h*h + 3*h*ffn) + h*vocab)
    attention, per pair: Q = 4 * layers * h      (QK^T and AV over one (query, key <= query) pair)
    cost(L) = 3 * (P*L + Q * L*(L+1)/2) = a*L^2 + b*L,   a = 1.5*Q,   b = 3*P + 1.5*Q

with h the hidden size and kv = kv_heads * h / heads the width of the keys and values. An image
costs what 256 tokens cost the linear layers (d = 256 * 3*P), as the default coefficients say.
Norms, rotary embeddings, softmax and the embedding lookup are left out: each is O(h) a token,
under 1% of P.
"""

from __future__ import annotations

from dataclasses import dataclass

from omniload.errors import ConfigError

_IMAGE_TOKENS = 256  # the linear cost of this many tokens is an image's (see cost.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int = 0  # 0: as many as heads (no grouped-query attention)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "ffn", "vocab"):
            if getattr(self, name) < 1:
                raise ConfigError(f"cost-model: {name} must be an integer >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ConfigError(f"cost-model: hidden {self.hidden} must be a multiple of heads {self.heads}")
        if not 0 <= self.kv_heads <= self.heads or (self.kv_heads and self.heads % self.kv_heads):
            raise ConfigError(
                f"cost-model: kv_heads must divide heads {self.heads} (0: as many as heads), got {self.kv_heads}"
            )

    @property
    def linear_flops(self) -> int:
        """Forward FLOPs of one token through the matrices (P above)."""
        h = self.hidden
        kv = (self.kv_heads or self.heads) * (h // self.heads)
        per_layer = h * (h + 2 * kv) + h * h + 3 * h * self.ffn
        return 2 * (self.layers * per_layer + h * self.vocab)

    @property
    def pair_flops(self) -> int:
        """Forward FLOPs of attention for one (query, key) pair over all layers (Q above)."""
        return 4 * self.layers * self.hidden

    def cost_coeffs(self) -> tuple[float, float, float, float]:
        """(a, b, c, d) of the cost a*L^2 + b*L + c + d*images, in training FLOPs."""
        a = 1.5 * self.pair_flops
        return (a, 3.0 * self.linear_flops + a, 0.0, _IMAGE_TOKENS * 3.0 * self.linear_flops)


# Llama 3.2 1B, Llama 3.1 8B and 70B, from their published configurations.
PRESETS = {
    "llama-1b": ModelShape(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    "llama-8b": ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "llama-70b": ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
}
_KEYS = ("layers", "hidden", "heads", "ffn", "vocab", "kv_heads")


def parse_model_shape(text: str) -> ModelShape:
    """A preset's name, or `layers=16,hidden=2048,heads=32,ffn=8192,vocab=128256[,kv_heads=8]`."""
    text = text.strip()
    if text in PRESETS:
        return PRESETS[text]
    usage = (
        f"cost-model {text!r}: give a preset ({', '.join(PRESETS)}) or the model's shape, "
        "e.g. layers=16,hidden=2048,heads=32,ffn=8192,vocab=128256[,kv_heads=8]"
    )
    fields: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in _KEYS:
            raise ConfigError(usage)
        try:
            fields[key] = int(value)
        except ValueError:
            raise ConfigError(f"cost-model: {key} must be an integer, got {value.strip()!r}") from None
    missing = [k for k in _KEYS[:5] if k not in fields]
    if missing:
        raise ConfigError(f"{usage}; missing: {', '.join(missing)}")
    return ModelShape(**fields)
