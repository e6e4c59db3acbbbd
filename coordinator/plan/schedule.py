"""Mixture weights over the run: declarative phases plus live changes; pure.

Phases apply in order: phase i holds while the position (steps, or tokens drawn, the same
unit for every phase) is below its `until`. With `ramp: linear` the weights move in a
straight line from where the previous phase ended (the sources' own weights before the
first phase) to this phase's weights. After the last phase its weights stay. A live change
(`omniload mix`) recorded at step s sets the weights from step s on and replaces the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

from omniload.spec import Phase


def weights_at(
    phases: Sequence[Phase],
    base: Sequence[float],
    names: Sequence[str],
    step: int,
    tokens: int,
    live: Sequence[tuple[int, dict[str, float]]] = (),
) -> list[float]:
    """Normalized weights for `step`, having drawn `tokens` tokens before it."""
    changes = [weights for at, weights in live if at <= step]
    if changes:
        return _normalized(_vector(changes[-1], names))
    start_weights, start = list(base), 0
    for phase in phases:
        position = step if phase.until_step is not None else tokens
        until = phase.until
        target = _vector(phase.weights, names)
        if position < until:
            if phase.ramp == "linear" and until > start:
                t = (position - start) / (until - start)
                return _normalized([a + (b - a) * t for a, b in zip(start_weights, target)])
            return _normalized(target)
        start_weights, start = target, until
    return _normalized(start_weights)


def _vector(weights: dict[str, float], names: Sequence[str]) -> list[float]:
    return [float(weights.get(name, 0.0)) for name in names]


def _normalized(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights] if total > 0 else weights


def in_force(live: Sequence[tuple[int, dict[str, float]]], step: int) -> list[tuple[int, dict[str, float]]]:
    """The live changes that decide the weights from `step` on: the last one recorded at or
    before it (each replaces all before it) and any recorded for later steps."""
    last = max((i for i, (at, _) in enumerate(live) if at <= step), default=None)
    return [change for i, change in enumerate(live) if i == last or change[0] > step]
