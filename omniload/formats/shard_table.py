"""A source's shards as columns: what the coordinator holds for a source of 10^5 objects.

A tuple of Shard dataclasses costs some 350 bytes a shard (the object, its path and version
strings, its ints), the columns here 72 (tracemalloc, 100,000 one-shard S3 objects with ETags,
2026-11-28): each number column is int32 where every value fits, the paths are one UTF-8 blob
with offsets (their common prefix once), and the versions 16 bytes each where they are 32-hex
ETags (an S3 object's MD5). A Shard is made on access, so every reader of the catalog sees the
Shards it always saw, and a table pickles to a worker in a few arrays.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from omniload.formats.shards import Shard

_NUMBERS = ("start", "stop", "rows", "first_ordinal", "byte_offset", "slice_rows")
_HEX32 = frozenset("0123456789abcdef")


def _column(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """int32 where every value fits, else int64."""
    array = np.asarray(values, dtype=np.int64)
    if len(array) and (array.min() < -(2**31) or array.max() >= 2**31):
        return array
    return array.astype(np.int32)


class _Texts:
    """Strings as one UTF-8 blob, offsets into it, and the prefix they all share."""

    __slots__ = ("_blob", "_ends", "_prefix")

    def __init__(self, texts: Sequence[str]) -> None:
        self._prefix = os.path.commonprefix(list(texts)) if texts else ""
        encoded = [t[len(self._prefix) :].encode() for t in texts]
        self._blob = b"".join(encoded)
        self._ends = _column(np.cumsum([len(e) for e in encoded], dtype=np.int64))

    @classmethod
    def from_parts(cls, blob: bytes, ends: np.ndarray, prefix: str) -> _Texts:
        texts = cls([])
        texts._blob, texts._ends, texts._prefix = blob, ends, prefix
        return texts

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> str:
        start = int(self._ends[i - 1]) if i else 0
        return self._prefix + self._blob[start : int(self._ends[i])].decode()

    def nbytes(self) -> int:
        return len(self._blob) + self._ends.nbytes + len(self._prefix)


class _Versions:
    """Objects' versions: 16 bytes each where all are 32-hex ETags, else text (_Texts)."""

    __slots__ = ("_hex", "_texts")

    def __init__(self, versions: Sequence[str]) -> None:
        if versions and all(len(v) == 32 and _HEX32.issuperset(v) for v in versions):
            self._hex: np.ndarray | None = np.frombuffer(bytes.fromhex("".join(versions)), np.uint8).reshape(-1, 16)
            self._texts: _Texts | None = None
        else:
            self._hex, self._texts = None, _Texts(versions)

    def __getitem__(self, i: int) -> str:
        if self._hex is not None:
            return bytes(self._hex[i]).hex()
        assert self._texts is not None
        return self._texts[i]

    def nbytes(self) -> int:
        return self._hex.nbytes if self._hex is not None else (self._texts.nbytes() if self._texts else 0)


class ShardTable(Sequence[Shard]):
    """Shards in columns; `table[i]` is the Shard `shards[i]` was."""

    __slots__ = ("_file_of", "_files", "_formats", "_format_of", "_numbers", "_sizes", "_versions")

    def __init__(self, shards: Sequence[Shard]) -> None:
        files: dict[str, int] = {}  # path -> file index, in first-seen order
        file_of: list[int] = []
        sizes: list[int] = []
        versions: list[str] = []
        format_of: list[int] = []
        formats: dict[str, int] = {}
        for shard in shards:
            index = files.setdefault(shard.file, len(files))
            if index == len(sizes):  # a file's size and version are its first shard's (all its shards agree)
                sizes.append(shard.size)
                versions.append(shard.version)
            file_of.append(index)
            format_of.append(formats.setdefault(shard.format, len(formats)))
        self._files = _Texts(list(files))
        self._file_of = _column(file_of)
        self._formats = tuple(formats)
        self._format_of = np.asarray(format_of, dtype=np.uint8)
        self._sizes = _column(sizes)
        self._versions = _Versions(versions)
        self._numbers = {name: _column([getattr(s, name) for s in shards]) for name in _NUMBERS}

    def __len__(self) -> int:
        return len(self._file_of)

    @overload
    def __getitem__(self, i: int) -> Shard: ...
    @overload
    def __getitem__(self, i: slice) -> list[Shard]: ...

    def __getitem__(self, i: int | slice) -> Shard | list[Shard]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"shard {i} of {len(self)}")
        f = int(self._file_of[i])
        numbers = {name: int(column[i]) for name, column in self._numbers.items()}
        return Shard(
            self._files[f],
            self._formats[self._format_of[i]],
            size=int(self._sizes[f]),
            version=self._versions[f],
            **numbers,
        )

    def __iter__(self) -> Iterator[Shard]:
        # the number columns as lists once, not a Shard's worth of array lookups per shard; a
        # file's path and version decoded when its first shard comes (an early stop decodes few)
        paths: list[str | None] = [None] * len(self._files)
        versions: list[str] = [""] * len(self._files)
        sizes = self._sizes.tolist()
        columns = [self._numbers[name].tolist() for name in _NUMBERS]
        for f, fmt, start, stop, rows, first, offset, slice_rows in zip(
            self._file_of.tolist(), self._format_of.tolist(), *columns
        ):
            path = paths[f]
            if path is None:
                path = paths[f] = self._files[f]
                versions[f] = self._versions[f]
            yield Shard(path, self._formats[fmt], start, stop, rows, first, offset, slice_rows, sizes[f], versions[f])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardTable | tuple | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # arrays inside: not hashable, as a list is not

    @property
    def formats(self) -> tuple[str, ...]:
        """The formats its files have."""
        return self._formats

    def column(self, name: str) -> np.ndarray:
        """A number column (start, stop, rows, first_ordinal, byte_offset, slice_rows) as an array,
        without making any Shard."""
        return self._numbers[name]

    @property
    def file_count(self) -> int:
        return len(self._files)

    def files(self) -> list[tuple[str, int, str, int]]:
        """Each file's (path, size, version, rows), in the order its first shard comes."""
        count = len(self._files)
        rows = np.bincount(self._file_of, weights=self._numbers["rows"], minlength=count).astype(np.int64)
        return [(self._files[f], int(self._sizes[f]), self._versions[f], int(rows[f])) for f in range(count)]

    def nbytes(self) -> int:
        """The bytes its columns hold."""
        arrays = [self._file_of, self._format_of, self._sizes, *self._numbers.values()]
        return sum(a.nbytes for a in arrays) + self._files.nbytes() + self._versions.nbytes()

    def __repr__(self) -> str:
        return f"ShardTable({len(self)} shards of {len(self._files)} files)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_table_from_state, (self._state(),))

    def _state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def _table_from_state(state: dict[str, Any]) -> ShardTable:
    table = ShardTable.__new__(ShardTable)
    for name, value in state.items():
        setattr(table, name, value)
    return table


def table_arrays(table: ShardTable, prefix: str) -> dict[str, np.ndarray]:
    """The table's columns as named arrays (np.savez's), each name under `prefix`."""
    files, versions = table._files, table._versions
    arrays = {
        "file_of": table._file_of,
        "format_of": table._format_of,
        "formats": _utf8("\0".join(table._formats)),
        "sizes": table._sizes,
        "file_blob": np.frombuffer(files._blob, np.uint8),
        "file_ends": files._ends,
        "file_prefix": _utf8(files._prefix),
        **{f"n_{name}": column for name, column in table._numbers.items()},
    }
    if versions._hex is not None:
        arrays["version_hex"] = versions._hex
    else:
        assert versions._texts is not None
        arrays |= {
            "version_blob": np.frombuffer(versions._texts._blob, np.uint8),
            "version_ends": versions._texts._ends,
            "version_prefix": _utf8(versions._texts._prefix),
        }
    return {f"{prefix}{name}": array for name, array in arrays.items()}


def table_from_arrays(arrays: Any, prefix: str) -> ShardTable:
    """The table table_arrays wrote (`arrays`: np.load's mapping); KeyError when one is missing."""

    def texts(name: str) -> _Texts:
        return _Texts.from_parts(
            arrays[f"{prefix}{name}_blob"].tobytes(),
            arrays[f"{prefix}{name}_ends"],
            arrays[f"{prefix}{name}_prefix"].tobytes().decode(),
        )

    versions = _Versions([])
    if f"{prefix}version_hex" in arrays:
        versions._hex, versions._texts = arrays[f"{prefix}version_hex"], None
    else:
        versions._hex, versions._texts = None, texts("version")
    formats = arrays[f"{prefix}formats"].tobytes().decode()
    return _table_from_state(
        {
            "_file_of": arrays[f"{prefix}file_of"],
            "_files": texts("file"),
            "_formats": tuple(formats.split("\0")) if formats else (),
            "_format_of": arrays[f"{prefix}format_of"],
            "_numbers": {name: arrays[f"{prefix}n_{name}"] for name in _NUMBERS},
            "_sizes": arrays[f"{prefix}sizes"],
            "_versions": versions,
        }
    )


def _utf8(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), np.uint8)
