"""A single-producer/single-consumer ring of variable-length records in shared memory.

Layout of the segment: a 128-byte header (write position at byte 0, read position at byte 64,
so producer and consumer never share a cache line; capacity at byte 8; the producer's CPU
nanoseconds and tokens written at bytes 16 and 24, which the autoscaler reads; the span at
byte 32; store retries, bytes fetched from a store and bytes held in the lane's block cache at
40, 48 and 56, which `status` shows; the lane's handover at byte 72, see below; the wall
nanoseconds its producers spent producing at byte 80, which the autoscaler reads; the sequence
number the consumer expects next at byte 88; the layout's magic and version at byte 96, which a
producer checks when it attaches, so a worker running other omniload code than its coordinator
stops with a clear error instead of reading the header at the wrong places), then `capacity`
bytes of data. Positions are
monotonic byte counters; a record is a 24-byte frame (its payload's length, its sequence
number, and an xxh3-64 digest of both and the payload) and its payload padded to 8 bytes, and
it may wrap around the end of the data area.

Every record is checked when it is read: its sequence number must be the one the consumer
expects (records are numbered from 0 when the ring is made, a reset skips past every number it
has held, and a new producer goes on after the newest record's) and its digest must match, so
a reader that lost its place or a record torn or overwritten never passes for data. A mismatch
raises RingCorrupt, naming the ring, the offset and what was found; the reader takes nothing.
The coordinator treats that as its worker's death: the worker is replaced and the ring reset,
and the lane is produced again from the source's cursor, so the order is kept
(coordinator/pool/intake.py).

Header words are read and stored whole, each in one aligned 8-byte access (see Ring.__init__),
so a producer killed while it publishes leaves the old write position or the new one, never a
torn one. Python stores the write position with a plain store after copying the record: on x86 (TSO)
a consumer that sees the position sees the record. A weakly ordered CPU (aarch64) may make
them visible out of order; there the checks see a record that is not all there yet, and the
reader reads it again after a pause before it calls the ring corrupt (_SETTLE_S).

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
import sys
import time
from pathlib import Path

import psutil
import xxhash

SHM_DIR = Path("/dev/shm")
PREFIX = "omniload-"
_HEADER = 128
# The header's words, by index (word i is at byte 8 * i).
_WRITE, _CAP, _CPU_NS, _TOKENS, _SPAN, _RETRIES, _FETCHED, _HELD, _READ = range(9)
_HANDOVER = 9  # RUNNING, ASKED (by the coordinator) or RELEASED (by the producer)
_BUSY_NS = 10  # wall time the producers spent producing, waits inside included (not idling)
_EXPECT = 11  # the sequence number of the next record the consumer reads
_LAYOUT_AT = 96  # the byte where _MAGIC sits: the layout a producer must agree with
_MAGIC = b"OLRING\x00\x02"  # version 2: checked records (24-byte frames)
RUNNING, ASKED, RELEASED = 0, 1, 2
_U64 = struct.Struct("<Q")
_FRAME = struct.Struct("<QQQ")  # payload length, sequence number, digest
FRAME = _FRAME.size  # bytes a record takes beyond its payload (and its padding to 8)
_PAD = (1 << 64) - 1  # a length that means: the rest of the data area is padding, go on at its start
_SETTLE_S = (0.0001, 0.001, 0.01)  # pauses before a record that fails its checks is read again


if sys.byteorder != "little":  # the header's words are native (Ring.__init__), the layout little-endian
    raise ImportError("omniload's shared-memory rings need a little-endian CPU (x86-64, aarch64)")


class RecordTooLarge(ValueError):
    pass


class RingCorrupt(Exception):
    """A record failed its checks: the reader lost its place, or the record was torn or
    overwritten. Names the ring, the offset and what was found."""


def _seed(seq: int, size: int) -> int:
    """The digest's seed: the frame's sequence number and length, so the digest covers them."""
    return (seq * 0x9E3779B97F4A7C15 + size) & _PAD


def _digest(seq: int, size: int, parts: tuple[memoryview, ...]) -> int:
    """xxh3-64 of the parts one after another (what the reader hashes in one piece)."""
    hasher = xxhash.xxh3_64(seed=_seed(seq, size))
    for part in parts:
        hasher.update(part)
    return int(hasher.intdigest())


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class Ring:
    """One SPSC ring. Use `Ring.create` in the coordinator, `Ring.attach` in the worker."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm
        # Every header word is read and stored whole, in one 8-byte access: struct.pack_into
        # stores a word a byte at a time (zeroing it first), so a producer killed inside it
        # left a torn write position, and the consumer read past the records into stale bytes
        # (scripts/ring_soak.py found it: one kill in about 1,500). A view of native 8-byte
        # words stores with one aligned move, which a kill cannot split. Native order is the
        # layout's little-endian on every platform omniload runs on (x86-64, aarch64).
        self._head = memoryview(mm)[:_HEADER].cast("Q")
        self.capacity: int = self._head[_CAP]
        self.span: int = self._head[_SPAN] or self.capacity
        self._allocated = self.span  # data bytes known to be allocated (the producer's view)
        self._seq: int | None = None  # the producer's next sequence number, found at its first write
        self.corrupt: str | None = None  # the consumer's: why a record failed its checks, until reset

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
        _U64.pack_into(mm, 8 * _CAP, capacity)
        _U64.pack_into(mm, 8 * _SPAN, span)
        mm[_LAYOUT_AT : _LAYOUT_AT + len(_MAGIC)] = _MAGIC
        return cls(path, mm)

    @classmethod
    def attach(cls, path: Path) -> Ring:
        """The ring at `path`, made by Ring.create; RingCorrupt if its layout is another
        omniload's."""
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        if mm[_LAYOUT_AT : _LAYOUT_AT + len(_MAGIC)] != _MAGIC:
            found = bytes(mm[_LAYOUT_AT : _LAYOUT_AT + len(_MAGIC)])
            mm.close()
            raise RingCorrupt(
                f"ring {path.name} has layout {found!r}, this omniload writes {_MAGIC!r}: the worker runs "
                "other omniload code than its coordinator (reinstall, so both import the same version)"
            )
        return cls(path, mm)

    # -- producer ---------------------------------------------------------------------------
    def try_write(self, *parts: bytes | memoryview) -> bool:
        """Append one record made of `parts`; False if there is no room yet."""
        views = tuple(memoryview(p).cast("B") for p in parts)
        size = sum(len(p) for p in views)
        total = FRAME + _pad8(size)
        if total > self.capacity:
            raise RecordTooLarge(f"record of {size} bytes does not fit a ring of {self.capacity} bytes")
        write = self._head[_WRITE]
        read = self._head[_READ]
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
        if self._seq is None:
            self._seq = self._next_seq()
        offset = self._copy_in(start, _FRAME.pack(size, self._seq, _digest(self._seq, size, views)))
        for part in views:
            offset = self._copy_in(offset, part)
        self._publish(write + pad + total)
        self._seq += 1
        return True

    def _next_seq(self) -> int:
        """Where a producer's numbering goes on: after the newest unread record's, else at the
        number the consumer expects (it stores that before it moves the read position)."""
        newest = self._newest_frame()
        if newest is not None:
            return int(_FRAME.unpack(newest)[1]) + 1
        return int(self._head[_EXPECT])

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
        self._head[_WRITE] = write

    def release_asked(self) -> bool:
        """The coordinator wants this lane to go to another producer: stop writing it, then
        `confirm_release`."""
        return bool(self._head[_HANDOVER] == ASKED)

    def confirm_release(self) -> None:
        """This producer writes no more records here."""
        self._head[_HANDOVER] = RELEASED

    def count_work(self, cpu_ns: int, tokens: int, busy_ns: int = 0) -> None:
        """Add to the lane's producer counters (kept across a reset: a replacement worker
        adds to its predecessor's, so readers see them only grow)."""
        self._head[_CPU_NS] = self._head[_CPU_NS] + cpu_ns
        self._head[_TOKENS] = self._head[_TOKENS] + tokens
        self._head[_BUSY_NS] = self._head[_BUSY_NS] + busy_ns

    def work(self) -> tuple[float, int, float]:
        """(CPU seconds, tokens, busy wall seconds) the lane's producers have spent, written and
        spent so far."""
        cpu, tokens, busy = (self._head[at] for at in (_CPU_NS, _TOKENS, _BUSY_NS))
        return cpu / 1e9, tokens, busy / 1e9

    def count_store(self, retries: int, fetched: int, held: int) -> None:
        """Add retries and fetched bytes to the lane's store counters (kept across a reset, as
        count_work's); set the bytes its block cache holds now."""
        self._head[_RETRIES] = self._head[_RETRIES] + retries
        self._head[_FETCHED] = self._head[_FETCHED] + fetched
        self._head[_HELD] = held

    def store(self) -> tuple[int, int, int]:
        """(retries, bytes fetched, bytes held) of the lane's reads from a store."""
        return (
            self._head[_RETRIES],
            self._head[_FETCHED],
            self._head[_HELD],
        )

    # -- consumer ---------------------------------------------------------------------------
    def ask_release(self) -> None:
        """Ask the producer to let the lane go (see the module's notes on handover)."""
        self._head[_HANDOVER] = ASKED

    @property
    def released(self) -> bool:
        """The producer asked to let go has stopped writing."""
        return bool(self._head[_HANDOVER] == RELEASED)

    def clear_release(self) -> None:
        """Before a new producer starts on the ring."""
        self._head[_HANDOVER] = RUNNING

    def read(self) -> bytes | None:
        """Take the oldest record, or None if the ring is empty. Raises RingCorrupt (taking
        nothing) when the record fails its checks."""
        read = self._head[_READ]
        if read == self._head[_WRITE]:
            return None
        expected = self._head[_EXPECT]
        found = self._checked(read, expected)
        for pause in _SETTLE_S:
            if not isinstance(found, str):
                break
            time.sleep(pause)  # (a weakly ordered CPU may not show all of a record yet)
            found = self._checked(read, expected)
        if isinstance(found, str):
            self.corrupt = f"ring {self.path.name}: {found}"
            raise RingCorrupt(self.corrupt)
        after, data = found
        self._head[_EXPECT] = expected + 1  # before the read position: see _next_seq
        self._head[_READ] = after
        return data

    def _checked(self, read: int, expected: int) -> tuple[int, bytes] | str:
        """(the read position after it, the payload) of the record at `read`, or what is wrong with it."""
        offset = read % self.capacity
        size = _U64.unpack_from(self._mm, _HEADER + offset)[0]
        if size == _PAD:  # published together with the record after it, which sits at the start
            read += self.capacity - offset
            offset = 0
            size = _U64.unpack_from(self._mm, _HEADER)[0]
        if size > self.capacity - FRAME:
            return f"the record at offset {offset} (position {read}) claims {size} bytes, more than the ring holds"
        if offset + FRAME <= self.capacity:  # (most frames: read in place, no copy)
            _, seq, digest = _FRAME.unpack_from(self._mm, _HEADER + offset)
        else:
            _, seq, digest = _FRAME.unpack(self._span_bytes(offset, FRAME))
        if seq != expected:
            return f"the record at offset {offset} (position {read}) is number {seq}, not {expected}: out of place"
        data = self._span_bytes((offset + FRAME) % self.capacity, size)
        if xxhash.xxh3_64_intdigest(data, seed=_seed(seq, size)) != digest:
            return (
                f"record {seq} at offset {offset} (position {read}, {size} bytes) fails its digest: torn or overwritten"
            )
        return read + FRAME + _pad8(size), data

    def _span_bytes(self, start: int, size: int) -> bytes:
        """`size` data bytes from offset `start`, across the end of the data area."""
        end = start + size
        if end <= self.capacity:
            return self._mm[_HEADER + start : _HEADER + end]
        return self._mm[_HEADER + start : _HEADER + self.capacity] + self._mm[_HEADER : _HEADER + end - self.capacity]

    def newest(self, head: int) -> bytes | None:
        """The first `head` bytes of the newest unread record's payload (what its producer wrote
        last), without taking anything; None if the ring is empty. A walk over the unread
        records: call it once a producer has stopped (a move), not per record."""
        found = self._newest_at()
        if found is None:
            return None
        offset, size = found
        return self._span_bytes((offset + FRAME) % self.capacity, min(size, head))

    def _newest_frame(self) -> bytes | None:
        found = self._newest_at()
        return None if found is None else self._span_bytes(found[0], FRAME)

    def _newest_at(self) -> tuple[int, int] | None:
        """(offset, payload size) of the newest unread record."""
        read = self._head[_READ]
        write = self._head[_WRITE]
        newest = None
        while read < write:
            offset = read % self.capacity
            size = _U64.unpack_from(self._mm, _HEADER + offset)[0]
            if size == _PAD:
                read += self.capacity - offset
                continue
            newest = offset, size
            read += FRAME + _pad8(size)
        return newest

    def used(self) -> int:
        write: int = self._head[_WRITE]
        read: int = self._head[_READ]
        return write - read

    def reset(self) -> None:
        """Drop every record. Only while no producer is attached (its worker is dead).

        Numbering goes on past every number the ring has held, so no stale record left in the
        data area can pass for the next one: at most capacity // FRAME records are unread, and
        one more may have been copied but not published when its producer died."""
        expected = self._head[_EXPECT]
        self._head[_WRITE] = 0
        self._head[_READ] = 0
        self._head[_EXPECT] = expected + self.capacity // FRAME + 2
        self.corrupt, self._seq = None, None
        self.clear_release()

    def close(self) -> None:
        self._head.release()  # (an mmap with a view on it refuses to close)
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
