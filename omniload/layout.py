"""Where a rank sits in the hybrid-parallel grid, and what it receives; pure.

The default rank order is Megatron's, `tp-cp-dp-pp` (fastest first): tp varies fastest, then
cp, then dp, then pp, i.e. `rank = tp_i + tp * (cp_i + cp * (dp_i + dp * pp_i))`. Ranks that
share a dp index form one data-parallel replica and receive the same step. Within a replica:
every cp rank gets its own slice of each row, only the first and last pipeline stage get data
(unless pp_data="all"), and with broadcast_at="tp" only tp rank 0 of each group connects.
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
    order: str = "tp-cp-dp-pp"

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world}")
        model = self.tp * self.pp * self.cp
        if self.world % model:
            raise ConfigError(
                f"world size {self.world} is not divisible by tp*pp*cp = "
                f"{self.tp}*{self.pp}*{self.cp} = {model}: change --tp/--pp/--cp or the number of ranks"
            )

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis."""
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is outside the world of {self.world} ranks")
        coords = {}
        for axis in self.order.split("-"):
            size = self.sizes()[axis]
            coords[axis] = rank % size
            rank //= size
        return coords

    def rank_of(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for axis in self.order.split("-"):
            rank += coords[axis] * stride
            stride *= self.sizes()[axis]
        return rank

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)["dp"]

    def needs_data(self, rank: int, pp_data: str = "first-last") -> bool:
        stage = self.coords(rank)["pp"]
        return pp_data == "all" or stage in (0, self.pp - 1)

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks that differ from `rank` only along `axis`, in axis order."""
        coords = self.coords(rank)
        return [self.rank_of({**coords, axis: i}) for i in range(self.sizes()[axis])]

    def connects(self, rank: int, broadcast_at: str = "none") -> bool:
        return broadcast_at != "tp" or self.coords(rank)["tp"] == 0
