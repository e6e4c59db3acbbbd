"""How far each rank has consumed, and who holds the job back; pure.

Every rank acknowledges the steps it consumed. The slowest rank's count decides what the
planner may plan (`--plan-ahead` steps beyond it), what may be checkpointed and which frames
may be dropped. An ACK is O(1): ranks are bucketed by their count, and the slowest count only
moves forward, so finding it again costs at most one look per step over the whole run.

`find_stall` says which rank the others wait for, when that is what is happening: the planner
cannot go further and some other rank has consumed everything planned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class Progress:
    """Steps consumed by each rank of the job (connected or not)."""

    def __init__(self, ranks: Iterable[int], start: int) -> None:
        self.consumed = {rank: start for rank in ranks}
        self._at: dict[int, set[int]] = {start: set(self.consumed)}  # steps consumed -> those ranks
        self.slowest = start

    def move(self, rank: int, to: int) -> int:
        """Set `rank`'s count to `to` (>= the slowest); returns how far the slowest moved."""
        if to < self.slowest:
            raise ValueError(f"rank {rank} cannot go back to step {to}: every rank has consumed {self.slowest}")
        was = self.consumed[rank]
        if to == was:
            return 0
        self._at[was].discard(rank)
        if not self._at[was]:
            del self._at[was]
        self._at.setdefault(to, set()).add(rank)
        self.consumed[rank] = to
        before = self.slowest
        while self.slowest not in self._at:
            self.slowest += 1
        return self.slowest - before

    def ranks_at(self, consumed: int) -> set[int]:
        """The ranks that have consumed exactly `consumed` steps."""
        return self._at.get(consumed, set())


@dataclass(frozen=True, slots=True)
class Stall:
    """The others wait for `rank`: it has consumed `consumed` steps and said nothing for `silent_s`."""

    rank: int
    consumed: int
    silent_s: float
    connection: str  # "connected", "gone" (disconnected without BYE), "said bye" or "never" (not yet)
    waiting: tuple[int, ...]  # ranks that have consumed every planned step
    ahead: int  # how many steps the waiting ranks are ahead of it

    def describe(self, plan_ahead: int, timeout_s: float) -> str:
        what = {
            "connected": f"rank {self.rank} has not acknowledged a batch for {self.silent_s:.0f}s",
            "gone": f"rank {self.rank} disconnected {self.silent_s:.0f}s ago without saying goodbye",
            "said bye": f"rank {self.rank} closed its loader {self.silent_s:.0f}s ago",
            "never": f"rank {self.rank} has not connected for {self.silent_s:.0f}s",
        }[self.connection] + f" (it has consumed {self.consumed} steps)"
        waiting = ", ".join(map(str, self.waiting[:8])) + (" ..." if len(self.waiting) > 8 else "")
        why = f"rank(s) {waiting} are {self.ahead} steps ahead of it and wait"
        if self.connection == "connected" and self.ahead >= plan_ahead:
            why += (
                f": --plan-ahead {plan_ahead} lets no rank get further ahead of the slowest. A rank that draws "
                "batches the others do not (say, for evaluation) blocks the job: draw the same number of "
                "batches on every rank"
            )
        limit = f"--rank-timeout {timeout_s:.0f}s" if timeout_s else "--rank-timeout is off"
        return f"{what}; {why} ({limit})"


def find_stall(
    progress: Progress,
    planned: int,
    plan_ahead: int,
    heard: Mapping[int, float],
    connection: Mapping[int, str],
    now: float,
    ended: bool = False,
) -> Stall | None:
    """The rank the others wait for, or None when nobody waits on a rank (e.g. on a slow source).

    `heard[rank]` is when the rank last acknowledged, connected or disconnected;
    `connection[rank]` is as in Stall. `ended`: the data has ended after `planned` steps, so
    ranks that have them all wait for the others to finish, whatever --plan-ahead says."""
    if not ended and planned - progress.slowest < plan_ahead:
        return None  # the planner is not held by the slowest rank
    waiting = [r for r in progress.ranks_at(planned) if connection.get(r) == "connected"]  # gone ranks wait for none
    laggards = progress.ranks_at(progress.slowest)
    if not waiting or planned == progress.slowest:
        return None
    rank = min(laggards, key=lambda r: (heard.get(r, now), r))
    return Stall(
        rank,
        progress.slowest,
        now - heard.get(rank, now),
        connection[rank],
        tuple(sorted(waiting)),
        planned - progress.slowest,
    )
