"""Mixing sources by tokens; pure.

Stride scheduling: each source has a pass value, the tokens it has had divided by its
weight. The next segment (a document or one chunk of a longer one) comes from the live source
with the lowest pass (ties to the lower index), so each source's token share tracks its weight
to within one segment, with no randomness: the sequence is a function of the weights and the
segments' lengths alone.
When weights change, passes carry on, and a source that just got a weight starts at the
current lowest pass, so it gets its new share from then on, with no burst to catch up.
"""

from __future__ import annotations

from collections.abc import Sequence


def next_source(passes: Sequence[float], weights: Sequence[float], live: Sequence[bool]) -> int | None:
    """Index of the source to draw from next, or None when no live source has weight."""
    best = None
    for s, (p, weight, alive) in enumerate(zip(passes, weights, live)):
        if alive and weight > 0 and (best is None or p < passes[best]):
            best = s
    return best


def advance(passes: list[float], source: int, tokens: int, weights: Sequence[float]) -> None:
    passes[source] += tokens / weights[source]


def join(passes: list[float], before: Sequence[float], after: Sequence[float]) -> None:
    """Sources whose weight became positive start at the lowest pass among the active ones."""
    active = [p for p, w in zip(passes, before) if w > 0]
    floor = min(active) if active else 0.0
    for s, (old, new) in enumerate(zip(before, after)):
        if old <= 0 < new:
            passes[s] = max(passes[s], floor)
