"""`--cache-dir`: blocks of remote objects on local disk, least recently used evicted past a limit.

A block's file name is the object's URL, version (ETag) and size hashed, and its index, so a
block of an object that changed is never found. Files are written whole to a temporary name
and renamed: a reader sees a block complete or not at all, with any number of workers and of
jobs on one node. A hit touches the file's mtime; the process that takes the total past the
limit evicts, under an flock on `.lock`, the least recently used files down to 90% of it. The
total is kept in `.usage` (under the same lock) so no process walks the folder per write; while
others write, the cache may pass the limit by the blocks being written (one a writer).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

_EVICT_TO = 0.9


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "omniload")


class DiskCache:
    def __init__(self, folder: str | Path, limit: int) -> None:
        self.folder = Path(folder) / "blocks"
        self.limit = limit
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.folder / ".lock"
        self._usage_path = self.folder / ".usage"

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / key

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # evicted since: the bytes read are still whole
        return data

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        if path.exists():
            return
        path.parent.mkdir(exist_ok=True)
        try:
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as f:
                f.write(data)
            os.replace(f.name, path)
        except OSError:  # a full disk: the cache is an optimisation, never a failure
            try:
                os.unlink(f.name)
            except (OSError, UnboundLocalError):
                pass
            return
        if self._add(len(data)) > self.limit:
            self.evict()

    def _add(self, nbytes: int) -> int:
        with self._locked():
            total = self._usage() + nbytes
            self._usage_path.write_text(str(total))
            return total

    def _usage(self) -> int:
        try:
            return int(self._usage_path.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def evict(self) -> None:
        """Remove the least recently used blocks down to 90% of the limit."""
        with self._locked():
            files = []
            for folder in self.folder.iterdir():
                if folder.is_dir():
                    for path in folder.iterdir():
                        try:
                            stat = path.stat()
                        except FileNotFoundError:
                            continue
                        if not path.name.startswith(".tmp-"):
                            files.append((stat.st_mtime, stat.st_size, path))
            total = sum(size for _, size, _ in files)
            files.sort()
            for _, size, path in files:
                if total <= self.limit * _EVICT_TO:
                    break
                try:
                    path.unlink()
                    total -= size
                except FileNotFoundError:
                    pass
            self._usage_path.write_text(str(total))

    def total(self) -> int:
        return self._usage()

    def _locked(self):  # type: ignore[no-untyped-def]
        return _Flock(self._lock_path)


class _Flock:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
