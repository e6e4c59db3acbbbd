"""Split the job's worker budget into lanes and lanes into workers; pure.

A lane is one source's share of shards, produced by one worker into one ring. With at least
as many workers as sources, every source gets one lane and the rest go by weight (largest
remainder), one lane per worker. With fewer, each source has one lane and lanes are packed
onto workers heaviest first (longest-processing-time), so one worker serves several light
sources.
"""

from __future__ import annotations

from collections.abc import Sequence


def lanes_per_source(weights: Sequence[float], budget: int) -> list[int]:
    k = len(weights)
    if budget <= k:
        return [1] * k
    total = sum(weights) or 1.0
    extra = budget - k
    quotas = [w / total * extra for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(k), key=lambda s: (-(quotas[s] - counts[s]), s))
    for s in by_remainder[: extra - sum(counts)]:
        counts[s] += 1
    return [1 + c for c in counts]


def assign_lanes(weights: Sequence[float], budget: int) -> list[list[tuple[int, int]]]:
    """Workers, each a list of (source, lane) it produces."""
    counts = lanes_per_source(weights, budget)
    lanes = [(s, j) for s, n in enumerate(counts) for j in range(n)]
    if len(lanes) <= budget:
        return [[lane] for lane in lanes]
    workers: list[list[tuple[int, int]]] = [[] for _ in range(budget)]
    load = [0.0] * budget
    for s, j in sorted(lanes, key=lambda lane: (-weights[lane[0]], lane)):
        w = min(range(budget), key=lambda i: (load[i], i))
        workers[w].append((s, j))
        load[w] += weights[s] / counts[s]
    return workers
