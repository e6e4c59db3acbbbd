"""Where the planner's waiting documents wait: files on local disk (a plan/spread.UnitStore).

A source's spread holds the documents whose units are not all drawn yet, up to its horizon
(hundreds of MB of token ids at the default), so their arrays go to disk, not to the
coordinator's heap. They are appended to segment files of `segment_bytes` through a write
buffer of _FLUSH_BYTES (one write call for hundreds of documents; a unit drawn before its bytes
are flushed is read from the buffer) and read back one unit at a time with pread, and a segment
is closed once every unit kept in it has been drawn. What they hold is in the page cache, kept
or dropped as the kernel sees fit, never in the coordinator's resident memory. (A read-only map
instead of pread saves a system call a unit, but a fault maps the page cache's whole folio: on
ext4 with large folios, ~180 KB a unit read, 36 MB of the coordinator's PSS after 200 reads.)
The files are unlinked from the start (tempfile.TemporaryFile), so nothing is left behind
whatever way the coordinator ends.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Sequence
from typing import IO

import numpy as np

from omniload.errors import OmniloadError

_OFFSET_BITS = 40  # a handle is segment << 40 | offset: a segment holds up to 1 TB
SEGMENT_BYTES = 64 << 20
_FLUSH_BYTES = 1 << 20


class Spill:
    """Segment files in `folder` (default: the system's temporary folder)."""

    def __init__(self, folder: str | None = None, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.folder = folder or tempfile.gettempdir()
        self._segment_bytes = segment_bytes
        self._files: dict[int, IO[bytes]] = {}
        self._live: dict[int, int] = {}  # segment -> units kept in it not drawn yet
        self._sizes: dict[int, int] = {}  # segment -> bytes kept in it, once it is not the current one
        self._current, self._capacity, self._size = -1, 0, 0  # the current segment's
        self._buffer = bytearray()  # the current segment's bytes from _flushed on, not written yet
        self._flushed = 0
        self.held_bytes = 0  # bytes in the open segments

    def put(self, parts: Sequence[np.ndarray], units: int) -> int:
        """Keep `parts`, C-contiguous arrays (a document's are: views of its ring record)."""
        size = 0
        for part in parts:
            size += part.nbytes
        if self._current < 0 or self._size + size > self._capacity:
            self._open_segment(size)
        offset, current = self._size, self._current
        buffer = self._buffer
        for part in parts:
            buffer += part.data.cast("B")
        if len(buffer) >= _FLUSH_BYTES:
            self._flush()
        self._size += size
        self.held_bytes += size
        self._live[current] += units
        return current << _OFFSET_BITS | offset

    def read(self, handle: int, offset: int, size: int) -> bytes:
        segment, at = handle >> _OFFSET_BITS, (handle & ((1 << _OFFSET_BITS) - 1)) + offset
        if segment == self._current and at >= self._flushed:  # still in the write buffer
            return bytes(self._buffer[at - self._flushed : at - self._flushed + size])
        return os.pread(self._files[segment].fileno(), size, at)

    def release(self, handle: int) -> None:
        segment = handle >> _OFFSET_BITS
        self._live[segment] -= 1
        if not self._live[segment] and segment != self._current:
            self._close(segment)

    def close(self) -> None:
        for segment in list(self._files):
            self._close(segment)

    def _flush(self) -> None:
        """Write the buffer at the end of the current segment."""
        fd, data = self._files[self._current].fileno(), memoryview(self._buffer)
        try:
            written = 0
            while written < len(data):  # a short write (rare on a local file): the rest
                written += os.pwrite(fd, data[written:], self._flushed + written)
        except OSError as exc:
            raise self._error(exc) from None
        finally:
            data.release()
        self._flushed += len(self._buffer)
        del self._buffer[:]  # (frees its allocation; a buffer kept and written in place measured no fewer instructions)

    def _open_segment(self, first: int) -> None:
        """A new segment of segment_bytes (or of `first` bytes, a document larger than that)."""
        if self._buffer:
            self._flush()
        previous = self._current
        capacity = max(self._segment_bytes, first)
        try:
            file = tempfile.TemporaryFile(dir=self.folder, prefix="omniload-spill-")
        except OSError as exc:
            raise self._error(exc) from None
        if previous >= 0:
            self._sizes[previous] = self._size
        self._current, self._capacity, self._flushed, self._size = previous + 1, capacity, 0, 0
        self._files[self._current] = file
        self._live[self._current] = 0
        if previous >= 0 and not self._live[previous]:
            self._close(previous)

    def _close(self, segment: int) -> None:
        if segment == self._current:
            self.held_bytes -= self._size
            del self._buffer[:]
        else:
            self.held_bytes -= self._sizes.pop(segment)
        self._files.pop(segment).close()
        del self._live[segment]

    def _error(self, exc: OSError) -> OmniloadError:
        if exc.errno == errno.ENOSPC:
            return OmniloadError(
                f"the shuffle's spill in {self.folder} filled its disk ({self.held_bytes >> 20} MB held): "
                "free space there, give --shuffle-dir a larger local disk, or shorten --shuffle-window"
            )
        return OmniloadError(f"the shuffle's spill in {self.folder}: {exc.strerror or exc} (--shuffle-dir)")
