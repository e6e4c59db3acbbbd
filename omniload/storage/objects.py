"""Objects in a store: list them, and read them as files through a bounded block cache.

A remote object is read in blocks of BLOCK bytes. A lane's `Blocks` holds at most its budget
(`--read-ahead`) of them: blocks it fetched ahead of the reader, and blocks read already, kept
while they fit, so the several strided passes over one parquet row group fetch it once. A
read fetches its missing blocks and the next ones after it in the background (sequential
readers — a column chunk, a JSON lines run, a tar member — find them there); `warm` fetches
a range the worker will read soon. With a disk cache (omniload.storage.disk_cache), a block
is looked for there before the store, and kept there after.

Transient store errors (timeouts, resets, also part-way through a body; 5xx, 429) are retried
with exponential backoff and jitter for up to RETRY_S; they change nothing a batch holds.
Anything else, or a transient error past the budget, raises StoreError naming the URL.
"""

from __future__ import annotations

import hashlib
import io
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import pyarrow.fs as pafs

from omniload.errors import ConfigError
from omniload.storage.disk_cache import DiskCache
from omniload.storage.stores import endpoint_of, explain, filesystem, hub_commit, is_transient, is_unreachable
from omniload.storage.urls import ObjectUrl, StoreOptions, glob_regex, glob_root, has_glob, parse, redact

BLOCK = 1 << 20
RETRY_S = 60.0  # transient errors (resets, 5xx, throttling) this long end the job
UNREACHABLE_S = 20.0  # an endpoint that refuses connections (or has no address) this long ends the job
_BACKOFF_S, _BACKOFF_MAX_S = 0.1, 8.0
FETCHERS = 8  # block requests in flight per lane
_LIST_THREADS = 16
T = TypeVar("T")
Block = bytes | memoryview  # a block as fetched (a view of the client's buffer) or read from the disk cache


class StoreError(OSError):
    """The store failed for good; the message names the URL and the likely fix."""


@dataclass(slots=True)
class Counters:
    """A lane's figures, for `status` (the worker writes them into its ring's header)."""

    retries: int = 0
    fetched: int = 0  # bytes from the store
    held: int = 0  # bytes in the block cache now


def retrying(
    action: Callable[[], T],
    where: str,
    url: ObjectUrl,
    options: StoreOptions,
    counters: Counters | None = None,
) -> T:
    """`action()`, retried while its errors are transient and the budget lasts (RETRY_S, or
    UNREACHABLE_S for an endpoint that refuses connections); StoreError else."""
    started = time.monotonic()
    delay = _BACKOFF_S
    while True:
        try:
            return action()
        except ConfigError:
            raise
        except (OSError, ValueError) as exc:  # pyarrow raises OSError (ArrowIOError); fsspec a few others
            if isinstance(exc, StoreError):
                raise
            budget = UNREACHABLE_S if is_unreachable(exc) else RETRY_S
            if not is_transient(exc) or time.monotonic() + delay > started + budget:
                suffix = f" (gave up after {budget:.0f}s of retries)" if is_transient(exc) else ""
                raise StoreError(explain(exc, where, url, options) + suffix) from None
            if counters is not None:
                counters.retries += 1
            time.sleep(delay * (0.5 + random.random()))  # jitter: workers retrying at once spread out
            delay = min(delay * 2, _BACKOFF_MAX_S)


def list_matching(pattern: str, options: StoreOptions) -> list[str]:
    """The URLs of the objects a URL (a glob, or one object) names, in key order; ConfigError when it names
    none, saying whether the bucket, the prefix or only the pattern is missing."""
    where = redact(pattern)
    url = pinned(parse(pattern), options, where)
    fs = filesystem(url, options)
    if not has_glob(url.key):
        info = retrying(lambda: fs.get_file_info(url.fs_path), where, url, options)
        if info.type == pafs.FileType.File:  # (as written, but a Hub URL at its commit)
            return [url.with_key(url.key)] if url.store == "hf" else [pattern]
        found = _listed(fs, url, url.key.rstrip("/") + "/" if url.key else "", options, recursive=True)
        if found:  # a folder: its files (as a local folder would not be): ask for a glob instead
            raise ConfigError(
                f"{where} is a folder of {len(found)} objects; name the files with a glob, "
                f"e.g. {where.rstrip('/')}/*.parquet"
            )
        _no_match(fs, url, options, pattern)
    root = glob_root(url.key)
    regex = glob_regex(url.key)
    recursive = "/" in url.key[len(root) :]
    found = [o for o in _listed(fs, url, root, options, recursive) if regex.match(o[0])]
    if not found:
        _no_match(fs, url, options, pattern)
    return [url.with_key(key) for key, _ in sorted(found)]


def pinned(url: ObjectUrl, options: StoreOptions, where: str) -> ObjectUrl:
    """A Hub URL at the commit its revision names now (`datasets/org/name@<sha>`), listed and
    read at that commit: what the job lists is what it reads, however the repository moves on.
    Other stores' objects carry their versions (ETags) instead, checked when a worker opens them."""
    if url.store != "hf":
        return url
    commit = retrying(lambda: hub_commit(url, options), where, url, options)
    return ObjectUrl(url.store, url.scheme, f"{url.bucket.partition('@')[0]}@{commit}", url.key, url.account)


def _listed(
    fs: pafs.FileSystem, url: ObjectUrl, prefix: str, options: StoreOptions, recursive: bool
) -> list[tuple[str, int]]:
    """(key, size) of the files under `prefix`. A deep listing lists each top folder in its own
    thread: a store pages through one listing 1,000 keys at a time, sequentially."""
    base = f"{url.bucket}/{prefix}".rstrip("/")
    where = redact(url.with_key(prefix))

    def one_level(path: str, deep: bool) -> list[pafs.FileInfo]:
        return retrying(
            lambda: fs.get_file_info(pafs.FileSelector(path, recursive=deep, allow_not_found=True)), where, url, options
        )

    top = one_level(base, False)
    files = [i for i in top if i.type == pafs.FileType.File]
    if recursive:
        folders = [i.path for i in top if i.type == pafs.FileType.Directory]
        with ThreadPoolExecutor(min(_LIST_THREADS, max(1, len(folders)))) as pool:
            for infos in pool.map(lambda path: one_level(path, True), folders):
                files.extend(i for i in infos if i.type == pafs.FileType.File)
    cut = len(url.bucket) + 1
    return [(i.path[cut:], i.size) for i in files]


def _no_match(fs: pafs.FileSystem, url: ObjectUrl, options: StoreOptions, pattern: str) -> None:
    where = redact(pattern)
    bucket = retrying(lambda: fs.get_file_info(url.bucket), where, url, options)
    if bucket.type == pafs.FileType.NotFound:
        raise ConfigError(
            f"{where}: bucket '{url.bucket}' does not exist at {endpoint_of(url, options)}; "
            "check its name (and the endpoint)"
        )
    root = glob_root(url.key) if has_glob(url.key) else url.key[: url.key.rfind("/") + 1]
    if root and not _listed(fs, url, root, options, recursive=False):
        raise ConfigError(f"{where}: nothing under {redact(url.with_key(root))} (no such prefix)")
    raise ConfigError(f"{where}: no objects match")


def version_of(metadata: dict) -> str:
    """The object's version as its store reports it on open: ETag, else generation, else ''."""
    for key in ("ETag", "etag", "generation", "Generation", "x-goog-generation"):
        value = metadata.get(key) or metadata.get(key.encode())
        if value:
            return (value.decode(errors="replace") if isinstance(value, bytes) else str(value)).strip('"')
    return ""


class Blocks:
    """One lane's block cache: at most `budget` bytes held, shared by every object it reads."""

    def __init__(
        self, budget: int, disk: DiskCache | None = None, counters: Counters | None = None, fetchers: int = FETCHERS
    ) -> None:
        self.budget = max(budget, 2 * BLOCK)
        self.fetchers = fetchers
        self.disk = disk
        self.counters = counters or Counters()
        self._held: OrderedDict[tuple[str, int], Block] = OrderedDict()  # least recently used first
        self._pending: dict[tuple[str, int], Future] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # made on first use: after the worker's fork

    def get(self, obj: RemoteObject, index: int, ahead: int) -> Block:
        """Block `index` of `obj`, and the next `ahead` blocks fetched in the background."""
        key = (obj.key, index)
        with self._lock:
            data = self._held.get(key)
            if data is not None:
                self._held.move_to_end(key)
            future = None if data is not None else self._submit(obj, index)
        if data is None:
            assert future is not None  # submitted above, under the lock
            data = future.result()
        self.prefetch(obj, range(index + 1, min(index + 1 + ahead, obj.blocks)))
        return data

    def prefetch(self, obj: RemoteObject, indices: range) -> None:
        """Fetch these blocks in the background while the budget allows."""
        with self._lock:
            for index in indices:
                if (obj.key, index) in self._held or (obj.key, index) in self._pending:
                    continue
                if self.counters.held + (len(self._pending) + 1) * BLOCK > self.budget:
                    break
                self._submit(obj, index)

    def _submit(self, obj: RemoteObject, index: int) -> Future:
        key = (obj.key, index)
        if key in self._pending:
            return self._pending[key]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.fetchers, thread_name_prefix="omniload-fetch")
        future = self._pool.submit(self._fetch, obj, index)
        self._pending[key] = future
        return future

    def _fetch(self, obj: RemoteObject, index: int) -> Block:
        key = (obj.key, index)
        data: Block | None
        try:
            data = self.disk.get(obj.cache_key(index)) if self.disk is not None else None
            if data is None:
                data = obj.fetch(index, self.counters)
                if self.disk is not None:
                    self.disk.put(obj.cache_key(index), data)
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)
            raise
        with self._lock:  # held before it stops being pending: a reader in between would fetch it again
            self._pending.pop(key, None)
            if key not in self._held:
                self._held[key] = data
                self.counters.held += len(data)
            while self.counters.held > self.budget and len(self._held) > 1:
                _, old = self._held.popitem(last=False)
                self.counters.held -= len(old)
        return data

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        with self._lock:
            self._held.clear()
            self.counters.held = 0


class RemoteObject:
    """One object of a store: its size and version, opened (a HEAD) on the first block that no
    cache holds, where a changed version is an error."""

    def __init__(self, url: str, options: StoreOptions, size: int | None = None, version: str = "") -> None:
        self.url, self.options = url, options
        self.parsed = parse(url)
        self.size = size
        self.version = version
        self._file: pafs.NativeFile | None = None
        self._lock = threading.Lock()
        if size is None:
            self._open(None)
        # blocks are cached under the object's URL, version and size: a changed object is never found
        self.key = hashlib.blake2b(f"{url}\0{self.version}\0{self.size}".encode(), digest_size=12).hexdigest()

    @property
    def blocks(self) -> int:
        assert self.size is not None
        return max(1, -(-self.size // BLOCK))

    def cache_key(self, index: int) -> str:
        return f"{self.key}-{index}"

    def _open(self, counters: Counters | None) -> pafs.NativeFile:
        with self._lock:
            if self._file is None:
                fs = filesystem(self.parsed, self.options)
                where = redact(self.url)
                file = retrying(
                    lambda: fs.open_input_file(self.parsed.fs_path), where, self.parsed, self.options, counters
                )
                version = version_of(retrying(file.metadata, where, self.parsed, self.options, counters))
                size = file.size()
                if self.size is None:
                    self.size, self.version = size, version
                elif size != self.size or (self.version and version and version != self.version):
                    raise StoreError(
                        f"{where} changed since the job listed it (size {self.size} -> {size}, version "
                        f"{self.version or '?'} -> {version or '?'}); batches would change: restore "
                        "it, or start a new job (a resume may pass --allow-changed-data)"
                    )
                self._file = file
            return self._file

    def fetch(self, index: int, counters: Counters) -> Block:
        file = self._open(counters)
        assert self.size is not None  # known once opened
        start = index * BLOCK
        length = min(BLOCK, self.size - start)

        def read() -> Block:
            data = memoryview(file.read_at(length, start))  # the fetched buffer itself, not a copy
            if len(data) != length:  # a body cut short without an error
                raise OSError(f"partial read: {len(data)} of {length} bytes")
            return data

        data = retrying(read, redact(self.url), self.parsed, self.options, counters)
        counters.fetched += len(data)
        return data


class RemoteFile(io.RawIOBase):
    """A remote object as a seekable binary file (what pyarrow's readers, gzip and tarfile read)."""

    def __init__(self, obj: RemoteObject, blocks: Blocks, ahead: int = 4) -> None:
        super().__init__()
        self.obj, self._blocks, self._ahead = obj, blocks, ahead
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        assert self.obj.size is not None
        return self.obj.size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size()}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def _pieces(self, size: int) -> Iterator[memoryview]:
        """The next `size` bytes (fewer at the end) as views of the blocks holding them."""
        end = min(self._pos + size, self.size())
        while self._pos < end:
            index, offset = divmod(self._pos, BLOCK)
            block = memoryview(self._blocks.get(self.obj, index, self._ahead))
            piece = block[offset : min(len(block), offset + end - self._pos)]
            self._pos += len(piece)
            yield piece

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        view, done = memoryview(buffer).cast("B"), 0
        for piece in self._pieces(len(view)):
            view[done : done + len(piece)] = piece
            done += len(piece)
        return done

    def read(self, size: int = -1) -> bytes:
        """One copy of the bytes, straight from the blocks (pyarrow's readers call this)."""
        return b"".join(self._pieces(self.size() if size is None or size < 0 else size))

    def readall(self) -> bytes:
        return self.read(-1)

    def warm(self, start: int, stop: int) -> None:
        """Fetch bytes [start, stop) in the background (within the lane's budget)."""
        stop = min(stop, self.size())
        if stop > start:
            self._blocks.prefetch(self.obj, range(start // BLOCK, (stop - 1) // BLOCK + 1))
