"""Sources in memory behind the coordinator's intake interface, for the real Stepper without
workers: the planner's unit tests, and bench_balance and bench_planner, which time it."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from omniload.coordinator.plan.documents import Doc


class MemoryIntake:
    """A source of `count` documents, `tokens_at(pos)` the ids of each, read `epochs` times in
    order, one group per epoch. `late`: the share of polls that find the record not in the ring
    yet (a worker behind), drawn from `seed`."""

    def __init__(
        self,
        index: int,
        count: int,
        tokens_at: Callable[[int], np.ndarray],
        epochs: int = 1,
        late: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.catalog = SimpleNamespace(index=index, name=f"s{index}", images=None)
        self._count, self._tokens_at, self._epochs = count, tokens_at, epochs
        self.group, self._p = 0, 0
        self._late, self._rng = late, np.random.default_rng(seed)

    @property
    def cursor(self) -> tuple[int, int]:
        return self.group, self._p

    @property
    def dry(self) -> bool:
        return self.group >= self._epochs

    def epoch_end(self, group: int) -> int:
        return group + 1

    def seek(self, group: int, pos: int) -> None:
        self.group, self._p = group, pos

    def poll(self, until_group: int | None = None) -> Doc | None:
        if self.dry or (until_group is not None and self.group >= until_group):
            return None
        if self._late and self._rng.random() < self._late:
            return None
        g, p = self.group, self._p
        self._p += 1
        if self._p == self._count:
            self.group, self._p = g + 1, 0
        return Doc(self.catalog.index, p, self._tokens_at(p), g, p, after=self.cursor)


class ListIntake(MemoryIntake):
    """A source whose document at position p has lengths[p] tokens (ids that differ by document)."""

    def __init__(self, index: int, lengths: list[int], epochs: int = 1, late: float = 0.0, seed: int = 0) -> None:
        super().__init__(index, len(lengths), self._tokens, epochs, late, seed)
        self._lengths = lengths

    def _tokens(self, p: int) -> np.ndarray:
        return (np.arange(self._lengths[p], dtype=np.int32) + 1000 * p) % 50_000
