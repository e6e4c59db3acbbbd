"""Where the planner's waiting documents wait: files on local disk (a plan/spread.UnitStore).

A source's spread holds the documents whose units are not all drawn yet, up to its horizon of
tokens (hundreds of MB of token ids at the default), so their arrays go to disk, not to the
coordinator's memory: appended to segment files of `segment_bytes`, read back one unit at a
time with pread, and a segment is closed once every unit kept in it has been drawn. The files
are unlinked from the start (tempfile.TemporaryFile), so nothing is left behind whatever way
the coordinator ends; what they hold is in the page cache while it is read soon, never in the
process's own memory.
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


class Spill:
    """Segment files in `folder` (default: the system's temporary folder)."""

    def __init__(self, folder: str | None = None, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.folder = folder or tempfile.gettempdir()
        self._segment_bytes = segment_bytes
        self._files: dict[int, IO[bytes]] = {}
        self._live: dict[int, int] = {}  # segment -> units kept in it not drawn yet
        self._current, self._size = -1, 0
        self.held_bytes = 0  # bytes in the open segments

    def put(self, parts: Sequence[np.ndarray], units: int) -> int:
        views = [np.ascontiguousarray(p).data.cast("B") for p in parts]
        size = sum(len(v) for v in views)
        if self._current < 0 or (self._size and self._size + size > self._segment_bytes):
            self._open_segment()
        offset, fd = self._size, self._files[self._current].fileno()
        try:
            written = os.pwritev(fd, views, offset)
            while written < size:  # a short write (rare on a local file): the rest
                rest = b"".join(views)[written:]
                written += os.pwrite(fd, rest, offset + written)
        except OSError as exc:
            raise self._error(exc) from None
        self._size += size
        self.held_bytes += size
        self._live[self._current] += units
        return self._current << _OFFSET_BITS | offset

    def read(self, handle: int, offset: int, size: int) -> bytes:
        segment, at = handle >> _OFFSET_BITS, handle & ((1 << _OFFSET_BITS) - 1)
        return os.pread(self._files[segment].fileno(), size, at + offset)

    def release(self, handle: int) -> None:
        segment = handle >> _OFFSET_BITS
        self._live[segment] -= 1
        if not self._live[segment] and segment != self._current:
            self._close(segment)

    def close(self) -> None:
        for segment in list(self._files):
            self._close(segment)

    def _open_segment(self) -> None:
        previous = self._current
        try:
            file = tempfile.TemporaryFile(dir=self.folder, prefix="omniload-spill-")
        except OSError as exc:
            raise self._error(exc) from None
        self._current, self._size = previous + 1, 0
        self._files[self._current], self._live[self._current] = file, 0
        if previous >= 0 and not self._live[previous]:
            self._close(previous)

    def _close(self, segment: int) -> None:
        file = self._files.pop(segment)
        self.held_bytes -= os.fstat(file.fileno()).st_size
        file.close()
        del self._live[segment]

    def _error(self, exc: OSError) -> OmniloadError:
        if exc.errno == errno.ENOSPC:
            return OmniloadError(
                f"the shuffle's spill in {self.folder} filled its disk ({self.held_bytes >> 20} MB held): "
                "free space there, give --shuffle-dir a larger local disk, or shorten --shuffle-window"
            )
        return OmniloadError(f"the shuffle's spill in {self.folder}: {exc.strerror or exc} (--shuffle-dir)")
