"""Where a rank sits in the hybrid-parallel grid; pure.

Rank order is Megatron's: tp varies fastest, then cp, then dp, then pp, i.e.
`rank = tp_i + tp * (cp_i + cp * (dp_i + dp * pp_i))`. Ranks that share a dp index belong to
one data-parallel replica and receive the same batch.
"""
from __future__ import annotations

from dataclasses import dataclass

from omniload.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world}")
        model = self.tp * self.pp * self.cp
        if self.world % model:
            raise ConfigError(f"world size {self.world} is not divisible by tp*pp*cp = "
                              f"{self.tp}*{self.pp}*{self.cp} = {model}: change --tp/--pp/--cp or the number of ranks")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    def dp_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is outside the world of {self.world} ranks")
        return (rank // (self.tp * self.cp)) % self.dp
