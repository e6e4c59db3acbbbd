"""A single-producer/single-consumer ring of variable-length records in shared memory.

Layout of the segment: a 128-byte header (write position at byte 0, read position at byte 64,
so producer and consumer never share a cache line; capacity at byte 8; the producer's CPU
nanoseconds and tokens written at bytes 16 and 24, which the autoscaler reads; the span at
byte 32; store retries, bytes fetched from a store and bytes held in the lane's block cache at
40, 48 and 56, which `status` shows; the lane's handover at byte 72, see below; the wall
nanoseconds its producers spent producing at byte 80, which the autoscaler reads), then
`capacity` bytes of data. Positions are monotonic byte counters; a
record is an
8-byte length and its payload padded to 8 bytes, and it may wrap around the end of the data area.

The capacity bounds one record; the span bounds the read-ahead's memory. A record starts
only within the first `span` bytes: once the write position has passed the span, the
producer pads the rest of the data area (a PAD length the consumer skips) and goes on at its
start, so with records smaller than the ring only about `span` bytes are ever touched. The
span is allocated when the ring is created; the rest of the segment is sparse and allocated
by the producer only when a record reaches into it (a long document), so a full /dev/shm
shows as ENOSPC there rather than as SIGBUS.

The producer copies a whole record before publishing the new write position, so a producer
that dies mid-record leaves nothing visible. A full ring makes `try_write` return False: the
caller waits, nothing is ever dropped.

A lane changes producer without a gap (a re-split gives it to another worker): the coordinator
asks its producer to let go (`ask_release`, RUNNING -> ASKED), the producer stops writing it
and says so (`confirm_release`, ASKED -> RELEASED), and the next producer, started once the
ring is RELEASED, goes on after its newest record (`clear_release` -> RUNNING first).

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
_WRITE, _CAP, _CPU_NS, _TOKENS, _SPAN, _RETRIES, _FETCHED, _HELD, _READ = 0, 8, 16, 24, 32, 40, 48, 56, 64
_HANDOVER = 72  # RUNNING, ASKED (by the coordinator) or RELEASED (by the producer)
_BUSY_NS = 80  # wall time the producers spent producing, waits inside included (not idling)
RUNNING, ASKED, RELEASED = 0, 1, 2
_U64 = struct.Struct("<Q")
_PAD = (1 << 64) - 1  # a length that means: the rest of the data area is padding, go on at its start


class RecordTooLarge(ValueError):
    pass


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class Ring:
    """One SPSC ring. Use `Ring.create` in the coordinator, `Ring.attach` in the worker."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm
        self.capacity: int = _U64.unpack_from(mm, _CAP)[0]
        self.span: int = _U64.unpack_from(mm, _SPAN)[0] or self.capacity
        self._allocated = self.span  # data bytes known to be allocated (the producer's view)

    @classmethod
    def create(cls, path: Path, capacity: int, span: int | None = None) -> Ring:
        """A new segment for records up to `capacity` bytes whose read-ahead touches about
        `span` bytes (default: the capacity); the span is allocated now, the rest stays
        sparse. OSError (ENOSPC when the directory is full) leaves no file behind."""
        capacity = _pad8(capacity)
        span = capacity if span is None else min(capacity, max(8, _pad8(span)))
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # The span is allocated now, not sparse: a full /dev/shm fails here with ENOSPC
            # instead of killing a worker by SIGBUS at some later write.
            os.posix_fallocate(fd, 0, _HEADER + span)
            os.ftruncate(fd, _HEADER + capacity)
            mm = mmap.mmap(fd, _HEADER + capacity)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        _U64.pack_into(mm, _CAP, capacity)
        _U64.pack_into(mm, _SPAN, span)
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
    def try_write(self, *parts: bytes | memoryview) -> bool:
        """Append one record made of `parts`; False if there is no room yet."""
        parts = tuple(memoryview(p).cast("B") for p in parts)
        size = sum(len(p) for p in parts)
        total = 8 + _pad8(size)
        if total > self.capacity:
            raise RecordTooLarge(f"record of {size} bytes does not fit a ring of {self.capacity} bytes")
        write = _U64.unpack_from(self._mm, _WRITE)[0]
        read = _U64.unpack_from(self._mm, _READ)[0]
        start = write % self.capacity
        pad = self.capacity - start if start >= self.span else 0  # past the span: go on at the start
        if pad + total > self.capacity:
            pad = 0  # a long record that would not fit even an empty ring after the pad: it goes where it is
        if write - read + pad + total > self.capacity:
            return False
        if pad:
            _U64.pack_into(self._mm, _HEADER + start, _PAD)
            start = 0
        if min(self.capacity, start + total) > self._allocated:  # a long record reaching past the span
            self._allocate(min(self.capacity, start + total))  # (what wraps around lands within it)
        offset = self._copy_in(start, _U64.pack(size))
        for part in parts:
            offset = self._copy_in(offset, part)
        self._publish(write + pad + total)
        return True

    def _allocate(self, end: int) -> None:
        """Allocate the data area up to `end` before writing there (OSError ENOSPC if
        /dev/shm is full), so a write to the sparse part never faults."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, _HEADER + self._allocated, end - self._allocated)
        finally:
            os.close(fd)
        self._allocated = end

    def _copy_in(self, offset: int, data: bytes | memoryview) -> int:
        first = min(len(data), self.capacity - offset)
        self._mm[_HEADER + offset : _HEADER + offset + first] = data[:first]
        rest = len(data) - first
        if rest:
            self._mm[_HEADER : _HEADER + rest] = data[first:]
        return (offset + len(data)) % self.capacity

    def _publish(self, write: int) -> None:
        _U64.pack_into(self._mm, _WRITE, write)

    def release_asked(self) -> bool:
        """The coordinator wants this lane to go to another producer: stop writing it, then
        `confirm_release`."""
        return bool(_U64.unpack_from(self._mm, _HANDOVER)[0] == ASKED)

    def confirm_release(self) -> None:
        """This producer writes no more records here."""
        _U64.pack_into(self._mm, _HANDOVER, RELEASED)

    def count_work(self, cpu_ns: int, tokens: int, busy_ns: int = 0) -> None:
        """Add to the lane's producer counters (kept across a reset: a replacement worker
        adds to its predecessor's, so readers see them only grow)."""
        _U64.pack_into(self._mm, _CPU_NS, _U64.unpack_from(self._mm, _CPU_NS)[0] + cpu_ns)
        _U64.pack_into(self._mm, _TOKENS, _U64.unpack_from(self._mm, _TOKENS)[0] + tokens)
        _U64.pack_into(self._mm, _BUSY_NS, _U64.unpack_from(self._mm, _BUSY_NS)[0] + busy_ns)

    def work(self) -> tuple[float, int, float]:
        """(CPU seconds, tokens, busy wall seconds) the lane's producers have spent, written and
        spent so far."""
        cpu, tokens, busy = (_U64.unpack_from(self._mm, at)[0] for at in (_CPU_NS, _TOKENS, _BUSY_NS))
        return cpu / 1e9, tokens, busy / 1e9

    def count_store(self, retries: int, fetched: int, held: int) -> None:
        """Add retries and fetched bytes to the lane's store counters (kept across a reset, as
        count_work's); set the bytes its block cache holds now."""
        _U64.pack_into(self._mm, _RETRIES, _U64.unpack_from(self._mm, _RETRIES)[0] + retries)
        _U64.pack_into(self._mm, _FETCHED, _U64.unpack_from(self._mm, _FETCHED)[0] + fetched)
        _U64.pack_into(self._mm, _HELD, held)

    def store(self) -> tuple[int, int, int]:
        """(retries, bytes fetched, bytes held) of the lane's reads from a store."""
        return (
            _U64.unpack_from(self._mm, _RETRIES)[0],
            _U64.unpack_from(self._mm, _FETCHED)[0],
            _U64.unpack_from(self._mm, _HELD)[0],
        )

    # -- consumer ---------------------------------------------------------------------------
    def ask_release(self) -> None:
        """Ask the producer to let the lane go (see the module's notes on handover)."""
        _U64.pack_into(self._mm, _HANDOVER, ASKED)

    @property
    def released(self) -> bool:
        """The producer asked to let go has stopped writing."""
        return bool(_U64.unpack_from(self._mm, _HANDOVER)[0] == RELEASED)

    def clear_release(self) -> None:
        """Before a new producer starts on the ring."""
        _U64.pack_into(self._mm, _HANDOVER, RUNNING)

    def read(self) -> bytes | None:
        """Take the oldest record, or None if the ring is empty."""
        read = _U64.unpack_from(self._mm, _READ)[0]
        if read == _U64.unpack_from(self._mm, _WRITE)[0]:
            return None
        offset = read % self.capacity
        size = _U64.unpack_from(self._mm, _HEADER + offset)[0]
        if size == _PAD:  # published together with the record after it, which sits at the start
            read += self.capacity - offset
            offset = 0
            size = _U64.unpack_from(self._mm, _HEADER)[0]
        start = (offset + 8) % self.capacity
        end = start + size
        if end <= self.capacity:
            data = self._mm[_HEADER + start : _HEADER + end]
        else:
            data = (
                self._mm[_HEADER + start : _HEADER + self.capacity] + self._mm[_HEADER : _HEADER + end - self.capacity]
            )
        _U64.pack_into(self._mm, _READ, read + 8 + _pad8(size))
        return data

    def newest(self, head: int) -> bytes | None:
        """The first `head` bytes of the newest unread record (what its producer wrote last),
        without taking anything; None if the ring is empty. A walk over the unread records:
        call it once a producer has stopped (a move), not per record."""
        read = _U64.unpack_from(self._mm, _READ)[0]
        write = _U64.unpack_from(self._mm, _WRITE)[0]
        newest = None
        while read < write:
            offset = read % self.capacity
            size = _U64.unpack_from(self._mm, _HEADER + offset)[0]
            if size == _PAD:
                read += self.capacity - offset
                continue
            newest = (offset + 8) % self.capacity, size
            read += 8 + _pad8(size)
        if newest is None:
            return None
        start, size = newest
        end = start + min(size, head)
        if end <= self.capacity:
            return self._mm[_HEADER + start : _HEADER + end]
        return self._mm[_HEADER + start : _HEADER + self.capacity] + self._mm[_HEADER : _HEADER + end - self.capacity]

    def used(self) -> int:
        write: int = _U64.unpack_from(self._mm, _WRITE)[0]
        read: int = _U64.unpack_from(self._mm, _READ)[0]
        return write - read

    def reset(self) -> None:
        """Drop every record. Only while no producer is attached (its worker is dead)."""
        _U64.pack_into(self._mm, _WRITE, 0)
        _U64.pack_into(self._mm, _READ, 0)
        self.clear_release()

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
