"""--cache-dir: blocks on local disk, least recently used first out, shared by processes."""

from __future__ import annotations

import multiprocessing
import os
import time

from omniload.storage.disk_cache import DiskCache


def test_blocks_past_the_limit_go_least_recently_used_first(tmp_path):
    cache = DiskCache(tmp_path, limit=12_500)
    written = time.time() - 100
    for i in range(4):
        cache.put(f"aa{i}", bytes([i]) * 3000)
        os.utime(cache._path(f"aa{i}"), (written + i, written + i))  # written one after another
    os.utime(cache._path("aa0"))  # a hit (get touches it) makes the oldest the newest
    assert cache.get("aa0") == bytes([0]) * 3000
    cache.put("aa4", b"x" * 3000)  # 15,000 > 12,500: evict down to 90% of the limit
    kept = {k for k in ("aa0", "aa1", "aa2", "aa3", "aa4") if cache.get(k) is not None}
    assert kept == {"aa0", "aa3", "aa4"} and cache.total() <= 11_250


def _writer(folder: str, worker: int) -> None:
    cache = DiskCache(folder, limit=200_000)
    for i in range(60):
        cache.put(f"k{i % 20:02d}-{worker % 2}", bytes([i % 20]) * 5000)
        data = cache.get(f"k{(i * 7) % 20:02d}-{(worker + 1) % 2}")
        assert data is None or data == bytes([(i * 7) % 20]) * 5000, "a reader saw a torn block"


def test_processes_sharing_a_cache_never_see_a_partial_block_and_stay_under_the_limit(tmp_path):
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_writer, args=(str(tmp_path), w)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    on_disk = sum(p.stat().st_size for p in (tmp_path / "blocks").rglob("k*") if p.is_file())
    assert on_disk <= 200_000 + 4 * 5000, "over the limit by more than one block a writer"
    assert not list((tmp_path / "blocks").rglob(".tmp-*")), "no temporary file left"


def _killed_mid_write(folder: str) -> None:
    cache = DiskCache(folder, limit=1 << 20)
    cache.folder.joinpath("ab").mkdir(exist_ok=True)
    with open(cache.folder / "ab" / f".tmp-{os.getpid()}-x1y2", "wb") as f:
        f.write(b"half a block")
    os._exit(9)  # as if killed before the rename


def test_what_a_writer_killed_mid_write_left_is_swept_and_a_live_writers_file_kept(tmp_path):
    """A job's start (and every eviction) removes the temporary files of writers that are gone;
    one a live process is writing stays."""
    writer = multiprocessing.get_context("fork").Process(target=_killed_mid_write, args=(str(tmp_path),))
    writer.start()
    writer.join()
    cache = DiskCache(tmp_path, limit=1 << 20)
    live = cache.folder / "ab" / f".tmp-{os.getpid()}-zz"
    live.write_bytes(b"being written")
    leftovers = list((cache.folder / "ab").glob(f".tmp-{writer.pid}-*"))
    assert len(leftovers) == 1
    assert cache.sweep() == leftovers
    assert live.exists() and not leftovers[0].exists()
