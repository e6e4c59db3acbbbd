"""A lane's block cache: the budget bounds what it holds, re-reads within it fetch nothing."""

from __future__ import annotations

import threading

from omniload.storage.objects import BLOCK, Blocks, Counters, RemoteFile


class _Object:
    """An object of `blocks` blocks whose fetches are counted (what RemoteObject does over a store)."""

    def __init__(self, blocks: int) -> None:
        self.key, self.blocks, self.size = "obj", blocks, blocks * BLOCK
        self.fetches: list[int] = []
        self._lock = threading.Lock()

    def cache_key(self, index: int) -> str:
        return f"{self.key}-{index}"

    def fetch(self, index: int, counters: Counters) -> bytes:
        with self._lock:
            self.fetches.append(index)
        counters.fetched += BLOCK
        return bytes([index % 256]) * BLOCK


def test_reading_an_object_holds_at_most_the_budget_and_fetches_each_block_once():
    obj = _Object(12)
    blocks = Blocks(budget=4 * BLOCK)
    file = RemoteFile(obj, blocks, ahead=4)  # type: ignore[arg-type]
    held = []
    for index in range(12):
        assert file.read(BLOCK) == bytes([index]) * BLOCK
        held.append(blocks.counters.held)
    blocks.close()
    assert max(held) <= 4 * BLOCK, held
    assert sorted(obj.fetches) == list(range(12)), "each block fetched once, read-ahead included"


def test_a_second_pass_within_the_budget_is_served_from_memory():
    """A parquet row group read in strided slices reads the same bytes once per slice."""
    obj = _Object(3)
    blocks = Blocks(budget=8 * BLOCK)
    for _ in range(5):
        file = RemoteFile(obj, blocks)  # type: ignore[arg-type]
        assert len(file.read()) == 3 * BLOCK
    blocks.close()
    assert sorted(obj.fetches) == [0, 1, 2]
