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

import heapq
from collections.abc import Sequence


def next_source(passes: Sequence[float], weights: Sequence[float], live: Sequence[bool]) -> int | None:
    """Index of the source to draw from next, or None when no live source has weight."""
    best = None
    for s, (p, weight, alive) in enumerate(zip(passes, weights, live)):
        if alive and weight > 0 and (best is None or p < passes[best]):
            best = s
    return best


class StrideQueue:
    """next_source's choices for a run of draws in which only the drawn source's pass moves
    (a step's draws): the live sources with weight kept as a heap of (pass, index), so ties
    still go to the lower index, at O(log sources) a draw instead of a pass over them all.
    It advances the caller's `passes` list in place, as advance() does."""

    def __init__(self, passes: list[float], weights: Sequence[float], live: Sequence[bool]) -> None:
        self._passes, self._weights = passes, weights
        self._heap = [(p, s) for s, (p, weight, alive) in enumerate(zip(passes, weights, live)) if alive and weight > 0]
        heapq.heapify(self._heap)

    def peek(self) -> int | None:
        """The source to draw from next (next_source's), or None when none is left."""
        return self._heap[0][1] if self._heap else None

    def advance(self, tokens: int) -> None:
        """The source peek() named has had `tokens` more."""
        source = self._heap[0][1]
        self._passes[source] += tokens / self._weights[source]  # advance's, inline: a call a draw
        heapq.heapreplace(self._heap, (self._passes[source], source))

    def drop(self) -> None:
        """The source peek() named has ended."""
        heapq.heappop(self._heap)


def advance(passes: list[float], source: int, tokens: int, weights: Sequence[float]) -> None:
    passes[source] += tokens / weights[source]


def join(passes: list[float], before: Sequence[float], after: Sequence[float]) -> None:
    """Sources whose weight became positive start at the lowest pass among the active ones."""
    active = [p for p, w in zip(passes, before) if w > 0]
    floor = min(active) if active else 0.0
    for s, (old, new) in enumerate(zip(before, after)):
        if old <= 0 < new:
            passes[s] = max(passes[s], floor)
