"""`--cache-dir`: blocks of remote objects on local disk, least recently used evicted past a limit.

A block's file name is the object's URL, version (ETag) and size hashed, and its index, so a
block of an object that changed is never found. Files are written whole to a temporary name
and renamed: a reader sees a block complete or not at all, with any number of workers and of
jobs on one node. A hit touches the file's mtime; the process that takes the total past the
limit evicts, under an flock on `.lock`, the least recently used files down to 90% of it. The
total is kept in `.usage` (under the same lock) so no process walks the folder per write; while
others write, the cache may pass the limit by the blocks being written (one a writer). A
temporary name carries its writer's pid, so what a writer killed mid-write left is found and
removed (`sweep`: at a job's start, and by every eviction) while live writers' are kept. A full
disk is not an error: the block is read from the store and not kept.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

import psutil

_EVICT_TO = 0.9
_TMP = ".tmp-"
_TMP_STALE_S = 24 * 3600.0  # a temporary file without a readable pid, older than this, is a leftover


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
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f"{_TMP}{os.getpid()}-", delete=False) as f:
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
                        if not path.name.startswith(_TMP):
                            files.append((stat.st_mtime, stat.st_size, path))
                        elif _left_behind(path.name, stat.st_mtime):
                            path.unlink(missing_ok=True)
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

    def sweep(self) -> list[Path]:
        """Remove the temporary files of writers that are gone (killed mid-write); the removed."""
        removed = []
        for folder in self.folder.iterdir():
            if folder.is_dir():
                for path in folder.glob(f"{_TMP}*"):
                    try:
                        if _left_behind(path.name, path.stat().st_mtime):
                            path.unlink()
                            removed.append(path)
                    except FileNotFoundError:
                        pass  # renamed or removed meanwhile
        return removed

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


def _left_behind(name: str, mtime: float) -> bool:
    """Whether a temporary file's writer is gone: its pid no longer runs (or, a name without
    one, it is a day old)."""
    pid = name[len(_TMP) :].split("-", 1)[0]
    if pid.isdigit():
        return not psutil.pid_exists(int(pid))
    return time.time() - mtime > _TMP_STALE_S
