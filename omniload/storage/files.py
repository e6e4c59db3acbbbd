"""How a lane (or the indexing child) opens its source's files: one door for local and remote.

Local paths are opened as before (pyarrow opens and maps them itself). A URL becomes a
RemoteFile over the lane's block cache (omniload.storage.objects), so every reader — parquet,
Arrow IPC, JSON lines, gzip, tar — reads a bucket as it reads a disk, fetching only the byte
ranges it asks for.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO

import pyarrow as pa

from omniload.storage.disk_cache import DiskCache
from omniload.storage.objects import FETCHERS, Blocks, Counters, RemoteFile, RemoteObject
from omniload.storage.urls import StoreOptions, is_remote

DEFAULT_READ_AHEAD = 64 << 20
_BUFFER = 256 << 10
_OBJECTS = 256  # objects kept open (each opened with one HEAD)


class Files:
    def __init__(
        self,
        options: StoreOptions | None = None,
        read_ahead: int = DEFAULT_READ_AHEAD,
        cache: DiskCache | None = None,
        fetchers: int = FETCHERS,
    ) -> None:
        self.options = options or StoreOptions()
        self.counters = Counters()
        self.blocks = Blocks(read_ahead, cache, self.counters, fetchers)
        self._objects: OrderedDict[str, RemoteObject] = OrderedDict()
        self._lock = threading.Lock()  # the indexing child opens many objects at once
        self._background: ThreadPoolExecutor | None = None

    def remote(self, path: str, size: int = 0, version: str = "") -> RemoteFile:
        """A URL's object as a file; `size` and `version` as listed (0: ask the store, once)."""
        with self._lock:
            obj = self._objects.get(path)
            if obj is not None:
                self._objects.move_to_end(path)
        if obj is None:  # opened outside the lock: a HEAD is a round trip
            obj = RemoteObject(path, self.options, size or None, version)
            with self._lock:
                self._objects[path] = obj
                while len(self._objects) > _OBJECTS:
                    self._objects.popitem(last=False)
        return RemoteFile(obj, self.blocks)

    def source(self, path: str, size: int = 0, version: str = "") -> str | RemoteFile:
        """What pyarrow's readers take: the path itself if local, else the remote file."""
        return self.remote(path, size, version) if is_remote(path) else path

    def open(self, path: str, size: int = 0, version: str = "") -> IO[bytes]:
        """A buffered binary file, as `open(path, "rb")` gives (lines and small reads are cheap)."""
        if is_remote(path):
            return io.BufferedReader(self.remote(path, size, version), _BUFFER)
        return open(path, "rb")

    def mapped(self, path: str, size: int = 0, version: str = "") -> pa.NativeFile | RemoteFile:
        """A local file memory-mapped (pages shared, read on touch); a remote one as a file."""
        return self.remote(path, size, version) if is_remote(path) else pa.memory_map(path)

    def in_background(self, task: Callable[[], object]) -> None:
        """Run `task` on the lane's one background thread (warming the next shards); its errors
        are dropped: the read that needs the bytes meets them again and reports them."""
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="omniload-warm")
        self._background.submit(_quietly, task)

    def close(self) -> None:
        if self._background is not None:
            self._background.shutdown(wait=True, cancel_futures=True)
            self._background = None
        self.blocks.close()
        self._objects.clear()


def _quietly(task: Callable[[], object]) -> None:
    try:
        task()
    except Exception:  # noqa: BLE001  (see Files.in_background)
        pass
