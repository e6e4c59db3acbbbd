"""The source-worker process: read shards, transform, write records into its rings.

A worker serves one or more lanes; a lane is one source's share of shards (see
omniload.order) with its own ring. The worker never blocks on one full ring while another
has room, so a worker serving several sources cannot stall the coordinator. It exits when
its lanes are done, when the coordinator is gone, or (killed) when the coordinator stops it.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omniload.order import group_members, groups_per_epoch, interleave_rows, row_permutation, shard_at
from omniload.workers.readers import BadFile, Shard, read_shard, use_system_allocator
from omniload.workers.records import doc_record, error_record, skip_record
from omniload.workers.ring import RecordTooLarge, Ring
from omniload.workers.transforms import Transform, load_transform

_BURST = 64  # records per lane before the worker looks at its other lanes
_TRANSFORM_ROWS = 256  # rows of a shard transformed at once
_IDLE_MIN_S, _IDLE_MAX_S = 50e-6, 5e-3


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneConfig:
    source_index: int
    source_name: str
    column: str
    tokenizer: str
    lane: int
    num_lanes: int
    ring_path: str
    shards: tuple[Shard, ...]
    seed: int
    epochs: int  # 0: forever
    interleave: int  # shards read together, their rows in turn (omniload.order)
    start_group: int  # the first group this lane produces
    start_pos: int  # position to start at within start_group (non-zero after a restart)
    skip_bad_files: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    worker_id: int
    coordinator_pid: int
    lanes: tuple[LaneConfig, ...]


def run_worker(config: WorkerConfig) -> None:
    """Process entry point (forked by the coordinator's pool)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    _exit_with(config.coordinator_pid)
    use_system_allocator()
    rings = [Ring.attach(Path(lane.ring_path)) for lane in config.lanes]
    producers = [_produce(lane) for lane in config.lanes]
    pending: list[tuple | None] = [None] * len(producers)
    live = list(range(len(producers)))
    idle = _IDLE_MIN_S
    while live:
        progressed = False
        for i in list(live):
            for _ in range(_BURST):
                if pending[i] is None:
                    pending[i] = next(producers[i], None)
                    if pending[i] is None:
                        live.remove(i)
                        break
                if not _write(rings[i], pending[i], config.lanes[i]):
                    break
                pending[i] = None
                progressed = True
        if not progressed:
            time.sleep(idle)
            idle = min(idle * 2, _IDLE_MAX_S)
        else:
            idle = _IDLE_MIN_S
    for ring in rings:
        ring.close()


def _write(ring: Ring, record: tuple, lane: LaneConfig) -> bool:
    try:
        return ring.try_write(*record)
    except RecordTooLarge as exc:
        return ring.try_write(*error_record(0, 0, f"{exc}: raise --ring-mb (now {ring.capacity >> 20} MB)"))


def _produce(lane: LaneConfig) -> Iterator[tuple]:
    """Records of this lane in the source's deterministic order, from (start_group, start_pos)."""
    transform = load_transform(lane.tokenizer)
    num_shards = len(lane.shards)
    end = lane.epochs * groups_per_epoch(num_shards, lane.interleave) if lane.epochs else None
    k, first_pos = lane.start_group, lane.start_pos
    while end is None or k < end:
        yield from _produce_group(lane, transform, k, first_pos)
        _release_freed_memory()
        k += lane.num_lanes
        first_pos = 0


def _produce_group(lane: LaneConfig, transform: Transform, k: int, first_pos: int) -> Iterator[tuple]:
    """Group k's records from position first_pos: its shards read together, their rows taken in
    turn (omniload.order.interleave_rows) and transformed a batch at a time, so the worker holds
    the group's raw values but never all of its tokens."""
    members = [shard_at(g, len(lane.shards), lane.seed, lane.source_index)
               for g in group_members(k, len(lane.shards), lane.interleave)]
    shards = [lane.shards[index] for _, index in members]
    member, row = interleave_rows([shard.rows for shard in shards])
    # a restarted group reads only the rows still due: each shard's from its first due row
    first_due = np.array([shard.rows for shard in shards])
    np.minimum.at(first_due, member[first_pos:], row[first_pos:])
    rows: list[_ShardRows | None] = []
    skipped: dict[int, str] = {}
    for m, ((epoch, index), shard) in enumerate(zip(members, shards)):
        order = row_permutation(shard.rows, lane.seed, lane.source_index, epoch, index)
        try:
            values = read_shard(shard, lane.column) if first_due[m] < shard.rows else []
        except BadFile as exc:
            message = f"{shard.file}: {exc}"
            if not lane.skip_bad_files:
                yield error_record(k, first_pos, message)
                return
            skipped[m] = f"skipped {shard.rows - first_due[m]} rows: {message}"
            rows.append(None)
            continue
        rows.append(_ShardRows(values, order, int(first_due[m]), transform))
    for pos in range(first_pos, len(member)):
        m, r = int(member[pos]), int(row[pos])
        if rows[m] is None:
            yield skip_record(k, pos, skipped.pop(m, ""))
            continue
        try:
            tokens = rows[m].tokens(r)
        except Exception as exc:  # the user's transform; its error must reach the user
            yield error_record(k, pos, f"{shards[m].file}: transform failed: {type(exc).__name__}: {exc}")
            return
        yield doc_record(k, pos, shards[m].first_ordinal + int(rows[m].order[r]), tokens)


class _ShardRows:
    """One shard's values in its row order, transformed _TRANSFORM_ROWS at a time; a value is
    dropped once transformed."""

    def __init__(self, values: list, order: np.ndarray, first: int, transform: Transform) -> None:
        self.order = order
        self._values, self._transform = values, transform
        self._start, self._batch = first, []

    def tokens(self, r: int) -> np.ndarray:
        """Row r's tokens; rows are asked for in increasing order."""
        if r >= self._start + len(self._batch):
            self._start, self._batch = r, []  # free the last batch before making the next
            picked = self.order[r : r + _TRANSFORM_ROWS].tolist()
            self._batch = _transform(self._transform, [self._values[i] for i in picked])
            for i in picked:
                self._values[i] = None
        return self._batch[r - self._start]


def _transform(transform: Transform, values: list) -> list[np.ndarray]:
    tokens = transform(values)
    if len(tokens) != len(values):
        raise ValueError(f"returned {len(tokens)} results for {len(values)} values")
    return [np.ascontiguousarray(t, dtype=np.int32) for t in tokens]


def _release_freed_memory() -> None:
    """Give the shard's freed buffers back to the OS: a worker's memory is the shard it holds,
    not the largest shard it ever read (glibc keeps freed heap otherwise)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def _exit_with(pid: int) -> None:
    """End this process as soon as the coordinator `pid` is gone, even mid-transform.

    The worker's parent is the forkserver, which by design outlives the coordinator while
    any worker lives, so the worker must watch the coordinator itself."""
    def watch() -> None:
        try:
            pidfd = os.pidfd_open(pid)
            select.select([pidfd], [], [])  # readable when the process exits
        except (AttributeError, OSError):  # no pidfd (old kernel, not Linux): poll
            while _alive(pid):
                time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="omniload-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
