"""The step arena: planned steps' frame payloads in shared memory, for the sender processes.

The coordinator copies each frame's payload here once; a sender writes it to its ranks'
sockets straight from the shared pages, so a batch's bytes never cross a socket between the
coordinator and a sender. Steps are let go in order (every rank has consumed them), so the
space is a FIFO ring: `FifoSpace` does the arithmetic (pure), `StepArena` holds the memory.

A step's bytes are reused only after every rank has acknowledged that step, which each does
only after reading all of its frame: by then no live connection still has them to send (a
dead one's unsent buffer may hold a stale view, which no one reads).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import deque
from pathlib import Path

log = logging.getLogger("omniload")


class FifoSpace:
    """Offsets in a ring of `size` bytes, taken per step and given back oldest step first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._head = 0  # bytes ever taken (a wrap's skipped tail counts as taken)
        self._tail = 0  # bytes ever given back
        self._steps: deque[tuple[int, int]] = deque()  # (step, its end in bytes ever taken), oldest first

    @property
    def used(self) -> int:
        return self._head - self._tail

    def take(self, step: int, length: int) -> int | None:
        """An offset for `length` contiguous bytes of `step` (steps in order), or None when full."""
        at = self._head % self.size
        skip = self.size - at if at + length > self.size else 0  # never split a payload at the wrap
        if self.used + skip + length > self.size:
            return None
        self._head += skip + length
        if self._steps and self._steps[-1][0] == step:
            self._steps[-1] = (step, self._head)
        else:
            self._steps.append((step, self._head))
        return 0 if skip else at

    def release_through(self, step: int) -> None:
        """Every step up to and including `step` is done with its bytes."""
        while self._steps and self._steps[0][0] <= step:
            self._tail = self._steps.popleft()[1]
        if not self._steps:
            self._tail = self._head


class StepArena:
    """A shared-memory segment the coordinator writes and its senders read.

    The segment is sparse and large; `reserve` allocates the part a job's steps need (known
    at its first step), so a full /dev/shm is an error then, never a SIGBUS at some write."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.path, self.capacity = path, capacity
        self._fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(self._fd, capacity)
            self._mm = mmap.mmap(self._fd, capacity)
        except OSError:
            self.close()
            raise
        self._view = memoryview(self._mm)
        self.space: FifoSpace | None = None  # None until reserved: puts find no room
        self._lock = threading.Lock()  # puts may come from the planner's thread, releases from the loop
        self._said_full = False

    def reserve(self, size: int) -> None:
        """Allocate the first `size` bytes (at most the capacity) and use only them; blocking
        (a thread's work): OSError when /dev/shm has no room."""
        size = min(size, self.capacity)
        os.posix_fallocate(self._fd, 0, size)
        self.space = FifoSpace(size)

    def put(self, step: int, data: bytes | memoryview) -> tuple[memoryview, tuple[int, int]] | None:
        """Copy `data` in: (a view of the copy, its (offset, length)), or None without room."""
        with self._lock:
            offset = self.space.take(step, len(data)) if self.space is not None else None
        if offset is None:
            if self.space is not None and not self._said_full:
                self._said_full = True
                log.warning(
                    "the step arena (%d MB) is full: some batches go to the senders over their sockets",
                    self.space.size >> 20,
                )
            return None
        end = offset + len(data)
        self._view[offset:end] = data
        return self._view[offset:end], (offset, len(data))

    def release_through(self, step: int) -> None:
        with self._lock:
            if self.space is not None:
                self.space.release_through(step)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            if hasattr(self, "_view"):
                self._view.release()
                self._mm.close()
        except BufferError:
            pass  # frames still hold views; the pages go when they do


def open_arena(path: str) -> memoryview:
    """A sender's read-only view of the coordinator's arena."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return memoryview(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
    finally:
        os.close(fd)
