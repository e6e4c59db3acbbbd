"""Mixing sources by tokens; pure.

The next document comes from the live source that is furthest behind its share of tokens
(`tokens[s] / weight[s]` smallest, ties to the lower index), so the token share of every
source tracks its normalized weight within one document at any point, with no randomness
needed: the sequence is a function of the weights and the documents' lengths alone.
"""
from __future__ import annotations

from collections.abc import Sequence


def next_source(tokens: Sequence[int], weights: Sequence[float], live: Sequence[bool]) -> int | None:
    """Index of the source to draw from next, or None when no live source has weight."""
    best, best_key = None, 0.0
    for s, (used, weight, alive) in enumerate(zip(tokens, weights, live)):
        if not alive or weight <= 0:
            continue
        key = used / weight
        if best is None or key < best_key:
            best, best_key = s, key
    return best


def shares(tokens: Sequence[int]) -> list[float]:
    total = sum(tokens)
    return [t / total if total else 0.0 for t in tokens]
