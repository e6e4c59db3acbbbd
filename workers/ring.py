"""A single-producer/single-consumer ring of variable-length records in shared memory.

Layout of the segment: a 128-byte header (write position at byte 0, read position at byte 64,
so producer and consumer never share a cache line; capacity at byte 8; the producer's CPU
nanoseconds and tokens written at bytes 16 and 24, which the autoscaler reads), then
`capacity` bytes of data. Positions are monotonic byte counters; a record is an 8-byte length and its payload
padded to 8 bytes, and it may wrap around the end of the data area.

The producer copies a whole record before publishing the new write position, so a producer
that dies mid-record leaves nothing visible. A full ring makes `try_write` return False: the
caller waits, nothing is ever dropped.

Segments live in /dev/shm under `omniload-<coordinator pid>-<job>-<lane>`: the coordinator
creates and unlinks them, workers attach and close, and `remove_stale_segments` removes the
leftovers of a job whose coordinator is gone.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")
PREFIX = "omniload-"
_HEADER = 128
_WRITE, _CAP, _CPU_NS, _TOKENS, _READ = 0, 8, 16, 24, 64
_U64 = struct.Struct("<Q")


class RecordTooLarge(ValueError):
    pass


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class Ring:
    """One SPSC ring. Use `Ring.create` in the coordinator, `Ring.attach` in the worker."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm
        self.capacity = _U64.unpack_from(mm, _CAP)[0]

    @classmethod
    def create(cls, path: Path, capacity: int) -> Ring:
        """A new segment with every byte allocated; OSError (ENOSPC when the directory is
        full) leaves no file behind."""
        capacity = _pad8(capacity)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Allocated now, not sparse: a full /dev/shm fails here with ENOSPC instead of
            # killing a worker by SIGBUS at some later write.
            os.posix_fallocate(fd, 0, _HEADER + capacity)
            mm = mmap.mmap(fd, _HEADER + capacity)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        _U64.pack_into(mm, _CAP, capacity)
        return cls(path, mm)

    @classmethod
    def attach(cls, path: Path) -> Ring:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        return cls(path, mm)

    # -- producer ---------------------------------------------------------------------------
    def max_record(self) -> int:
        return self.capacity - 8

    def try_write(self, *parts: bytes | memoryview) -> bool:
        """Append one record made of `parts`; False if there is no room yet."""
        parts = tuple(memoryview(p).cast("B") for p in parts)
        size = sum(len(p) for p in parts)
        total = 8 + _pad8(size)
        if total > self.capacity:
            raise RecordTooLarge(f"record of {size} bytes does not fit a ring of {self.capacity} bytes")
        write = _U64.unpack_from(self._mm, _WRITE)[0]
        read = _U64.unpack_from(self._mm, _READ)[0]
        if write - read + total > self.capacity:
            return False
        offset = self._copy_in(write % self.capacity, _U64.pack(size))
        for part in parts:
            offset = self._copy_in(offset, part)
        self._publish(write + total)
        return True

    def _copy_in(self, offset: int, data: bytes | memoryview) -> int:
        first = min(len(data), self.capacity - offset)
        self._mm[_HEADER + offset : _HEADER + offset + first] = data[:first]
        rest = len(data) - first
        if rest:
            self._mm[_HEADER : _HEADER + rest] = data[first:]
        return (offset + len(data)) % self.capacity

    def _publish(self, write: int) -> None:
        _U64.pack_into(self._mm, _WRITE, write)

    def count_work(self, cpu_ns: int, tokens: int) -> None:
        """Add to the lane's producer counters (kept across a reset: a replacement worker
        adds to its predecessor's, so readers see them only grow)."""
        _U64.pack_into(self._mm, _CPU_NS, _U64.unpack_from(self._mm, _CPU_NS)[0] + cpu_ns)
        _U64.pack_into(self._mm, _TOKENS, _U64.unpack_from(self._mm, _TOKENS)[0] + tokens)

    def work(self) -> tuple[float, int]:
        """(CPU seconds, tokens) the lane's producers have spent and written so far."""
        return _U64.unpack_from(self._mm, _CPU_NS)[0] / 1e9, _U64.unpack_from(self._mm, _TOKENS)[0]

    # -- consumer ---------------------------------------------------------------------------
    def read(self) -> bytes | None:
        """Take the oldest record, or None if the ring is empty."""
        read = _U64.unpack_from(self._mm, _READ)[0]
        if read == _U64.unpack_from(self._mm, _WRITE)[0]:
            return None
        offset = read % self.capacity
        size = _U64.unpack_from(self._mm, _HEADER + offset)[0]
        start = (offset + 8) % self.capacity
        end = start + size
        if end <= self.capacity:
            data = self._mm[_HEADER + start : _HEADER + end]
        else:
            data = self._mm[_HEADER + start : _HEADER + self.capacity] + self._mm[_HEADER : _HEADER + end - self.capacity]
        _U64.pack_into(self._mm, _READ, read + 8 + _pad8(size))
        return data

    def used(self) -> int:
        return _U64.unpack_from(self._mm, _WRITE)[0] - _U64.unpack_from(self._mm, _READ)[0]

    def reset(self) -> None:
        """Drop every record. Only while no producer is attached (its worker is dead)."""
        _U64.pack_into(self._mm, _WRITE, 0)
        _U64.pack_into(self._mm, _READ, 0)

    def close(self) -> None:
        self._mm.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def segment_path(coordinator_pid: int, job_id: str, name: str) -> Path:
    return SHM_DIR / f"{PREFIX}{coordinator_pid}-{job_id}-{name}"


def job_segments(job_id: str) -> list[Path]:
    return sorted(p for p in SHM_DIR.glob(f"{PREFIX}*-{job_id}-*"))


def remove_stale_segments() -> list[Path]:
    """Unlink the segments of jobs whose coordinator process no longer exists."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
