"""Pre-tokenized files: Megatron indexed datasets (`.bin` + `.idx`) and flat token files.

A Megatron indexed dataset (megatron/core/datasets/indexed_dataset.py, the "MMIDIDX" index) is
a `.bin` of token ids back to back and an `.idx` beside it, laid out as

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          uint64    1
    dtype code       uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count   uint64    S
    document count   uint64    D (one more than the documents: the list starts with 0)
    sequence lengths int32[S]  tokens of each sequence
    pointers         int64[S]  byte offset of each sequence in the .bin
    document indices int64[D]  document d is sequences [indices[d], indices[d + 1])
    (sequence modes  int8[S]   multimodal datasets only; not read)

all little-endian. A document (usually one sequence; several when the preprocessing split
sentences) is one row. A flat token file (nanoGPT's `train.bin`) is token ids only; its
documents end at each `eos` id (the id stays with the document it ends), and tokens after the
last `eos` are one more document.

Both are indexed into shards of whole documents of about SHARD_TOKENS tokens. A Megatron shard's
start/stop are document numbers; a flat file's are token offsets, its documents found again
when a slice is read. Reading maps a local file and reads a store's object in byte ranges
(omniload.storage), so a slice costs its own documents, never the file. Each document's ids are
checked against the declared vocabulary here, where the offset in the file is known.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from omniload.formats.lane_config import Pretokenized
from omniload.formats.records import ids_fit_uint16
from omniload.formats.shards import BadFile, Shard, slice_rows_for
from omniload.storage.files import Files

MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
SHARD_TOKENS = 1 << 20  # a shard holds whole documents of about this many tokens
_SCAN_TOKENS = 1 << 22  # a flat file is scanned for its eos ids this many tokens at a time
_INT32_MAX = (1 << 31) - 1


class _RangeFile(Protocol):
    def seek(self, offset: int, whence: int = ..., /) -> int: ...
    def read(self, size: int = ..., /) -> bytes: ...


def index_path(bin_path: str) -> str:
    """The .idx beside a Megatron .bin."""
    return bin_path[: -len(".bin")] + ".idx" if bin_path.endswith(".bin") else bin_path + ".idx"


@dataclass(frozen=True, slots=True)
class MegatronHeader:
    """What an .idx's header says, and where its arrays start."""

    dtype: np.dtype
    sequences: int
    documents: int  # rows: one less than the document-index entries

    @property
    def lengths_at(self) -> int:
        return _HEADER.size

    @property
    def pointers_at(self) -> int:
        return _HEADER.size + 4 * self.sequences

    @property
    def doc_index_at(self) -> int:
        return _HEADER.size + 12 * self.sequences

    @property
    def end(self) -> int:
        """The smallest .idx this header fits (the optional modes follow)."""
        return self.doc_index_at + 8 * (self.documents + 1)


def parse_header(data: bytes, idx_size: int, name: str = "index") -> MegatronHeader:
    """The header of an .idx of `idx_size` bytes from its first bytes; BadFile naming what is
    wrong, the file called `name`."""
    if len(data) < _HEADER.size:
        raise BadFile(f"{name} is truncated: {idx_size} bytes, a header takes {_HEADER.size}")
    magic, version, code, sequences, entries = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadFile(f"{name} does not start with Megatron's {MAGIC!r} (found {magic!r}): not an MMIDIDX .idx file")
    if version != 1:
        raise BadFile(f"{name} version {version}; omniload reads version 1 of the MMIDIDX layout")
    if code not in DTYPE_CODES:
        raise BadFile(f"{name} names dtype code {code}; known codes: {sorted(DTYPE_CODES)}")
    dtype = np.dtype(DTYPE_CODES[code])
    if dtype.kind == "f":
        raise BadFile(f"{name} says the tokens are {dtype} (dtype code {code}): token ids are integers")
    if entries < 1:
        raise BadFile(f"{name} has no document-index entries (it starts with 0 even with no documents)")
    header = MegatronHeader(dtype, sequences, entries - 1)
    if idx_size < header.end:
        raise BadFile(
            f"{name} is truncated: {idx_size} bytes, its header ({sequences} sequences, "
            f"{entries - 1} documents) needs {header.end}"
        )
    return header


def check_tokens(tokens: np.ndarray, vocab: int | None) -> int | None:
    """Where the first id that is negative or not below `vocab` (or beyond int32) sits, or None."""
    if not len(tokens):
        return None
    high = _INT32_MAX + 1 if vocab is None else vocab
    bad = (tokens < 0) | (tokens >= high)
    return int(np.argmax(bad)) if bad.any() else None


# where a source's vocabulary comes from, and how to change it (catalog.pretokenized_of)
VOCAB_FROM = "vocab=, else the source's tokenizer's; set vocab= to the vocabulary the ids were made with"


def record_ids(tokens: np.ndarray, vocab: int | None) -> np.ndarray:
    """Checked ids (check_tokens) as a copy in the type a ring record keeps (formats/records.py):
    uint16 where every id must fit it, from a uint8 or uint16 file or below a vocabulary of at
    most 65,536, else int32. The record narrows int32 ids that fit anyway, after a pass over
    them per document: ids known to fit skip that pass and a copy."""
    if ids_fit_uint16(tokens.dtype, vocab):
        return tokens.astype(np.uint16)
    return tokens.astype(np.int32)


def _checked(tokens: np.ndarray, vocab: int | None, where: str, offset: int) -> np.ndarray:
    """The ids as a record keeps them (record_ids); BadFile naming the first bad one's offset
    (`offset`: the document's first token's)."""
    bad = check_tokens(tokens, vocab)
    if bad is not None:
        limit = f"the vocabulary size {vocab} ({VOCAB_FROM})" if vocab is not None else "2**31"
        raise BadFile(f"token id {int(tokens[bad])} at token offset {offset + bad} ({where}) is not below {limit}")
    return record_ids(tokens, vocab)


def _read(file: _RangeFile, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
    file.seek(offset)
    data = file.read(count * dtype.itemsize)
    if len(data) != count * dtype.itemsize:
        raise BadFile(f"ends at byte {offset + len(data)}, {count * dtype.itemsize - len(data)} bytes short")
    return np.frombuffer(data, dtype=dtype.newbyteorder("<"))


def _size(path: str, files: Files) -> int:
    with files.mapped(path) as f:
        return int(f.size())


def index_megatron(path: str, ordinal: int, files: Files) -> list[Shard]:
    """Shards of a Megatron .bin of whole documents, read from its .idx: the header, the first
    and last document-index entries and the last sequence (the .bin must hold it)."""
    idx = index_path(path)
    try:
        idx_size = _size(idx, files)
    except (FileNotFoundError, OSError) as exc:
        raise BadFile(
            f"no Megatron index {idx} beside it ({type(exc).__name__}); a flat token file such as "
            "nanoGPT's train.bin needs format=tokens,eos=ID"
        ) from None
    with files.mapped(idx) as f:
        header = parse_header(f.read(_HEADER.size), idx_size, f"index {idx}")
        first = int(_read(f, header.doc_index_at, 1, np.dtype(np.int64))[0])
        last = int(_read(f, header.end - 8, 1, np.dtype(np.int64))[0])
        if first != 0 or last != header.sequences:
            raise BadFile(
                f"index {idx}: its document indices run from {first} to {last}; they must run from 0 to the "
                f"{header.sequences} sequences"
            )
        tail = 0
        if header.sequences:
            length = int(_read(f, header.lengths_at + 4 * (header.sequences - 1), 1, np.dtype(np.int32))[0])
            pointer = int(_read(f, header.pointers_at + 8 * (header.sequences - 1), 1, np.dtype(np.int64))[0])
            tail = pointer + length * header.dtype.itemsize
    bin_size = _size(path, files)
    if bin_size < tail:
        raise BadFile(f"is truncated: {bin_size} bytes, its index places the last sequence up to byte {tail}")
    tokens = bin_size // header.dtype.itemsize
    per_shard = max(1, min(header.documents, SHARD_TOKENS * header.documents // max(tokens, 1)))
    shards = []
    for start in range(0, header.documents, per_shard):
        stop = min(start + per_shard, header.documents)
        nbytes = bin_size * (stop - start) // header.documents
        shards.append(_shard(path, "megatron", start, stop, stop - start, ordinal + start, nbytes))
    return shards or [Shard(path, "megatron", 0, 0, 0, ordinal)]


def _shard(
    path: str, fmt: str, start: int, stop: int, rows: int, ordinal: int, nbytes: int, byte_offset: int = 0
) -> Shard:
    """A shard of `rows` documents taking about `nbytes` bytes of the file (from `byte_offset`, if known)."""
    return Shard(path, fmt, start, stop, rows, ordinal, byte_offset, slice_rows=slice_rows_for(rows, nbytes))


def megatron_rows(shard: Shard, rows: Sequence[int], files: Files, vocab: int | None) -> list[np.ndarray]:
    """Documents `rows` (rows of the shard, in increasing order) as token arrays (record_ids)."""
    idx = index_path(shard.file)
    with files.mapped(idx) as f:
        header = parse_header(f.read(_HEADER.size), _size(idx, files))
        doc_index = _read(f, header.doc_index_at + 8 * shard.start, shard.rows + 1, np.dtype(np.int64))
        first, count = int(doc_index[0]), int(doc_index[-1] - doc_index[0])
        lengths = _read(f, header.lengths_at + 4 * first, count, np.dtype(np.int32))
        pointers = _read(f, header.pointers_at + 8 * first, count, np.dtype(np.int64))
    itemsize = header.dtype.itemsize
    out = []
    with files.mapped(shard.file, shard.size, shard.version) as data:
        for r in rows:
            a, b = int(doc_index[r]) - first, int(doc_index[r + 1]) - first
            if a == b:
                out.append(np.zeros(0, np.int32))
                continue
            start = int(pointers[a])
            # a document's sequences lie back to back in the .bin
            count_tokens = int(pointers[b - 1] - start) // itemsize + int(lengths[b - 1])
            tokens = _read(data, start, count_tokens, header.dtype)
            where = f"document {shard.start + r}"
            out.append(_checked(tokens, vocab, where, start // itemsize))
    return out


def index_flat(path: str, layout: Pretokenized, ordinal: int, files: Files) -> list[Shard]:
    """Shards of a flat token file: one pass finds its eos ids; each shard ends at a document's end."""
    if layout.eos is None:
        raise BadFile("a flat token file needs eos=ID, the id that ends each document")
    dtype = np.dtype(layout.dtype)
    size = _size(path, files)
    if size % dtype.itemsize:
        raise BadFile(f"{size} bytes is not a whole number of {dtype} tokens: a wrong dtype=, or a truncated file")
    total = size // dtype.itemsize
    shards: list[Shard] = []
    start = rows = 0  # the open shard's first token, and its documents ended so far

    def close(stop: int) -> None:
        nonlocal start, rows, ordinal
        nbytes = (stop - start) * dtype.itemsize
        shards.append(_shard(path, "tokens", start, stop, rows, ordinal, nbytes, start * dtype.itemsize))
        start, ordinal, rows = stop, ordinal + rows, 0

    with files.mapped(path) as f:
        for base in range(0, total, _SCAN_TOKENS):
            chunk = _read(f, base * dtype.itemsize, min(_SCAN_TOKENS, total - base), dtype)
            ends = np.flatnonzero(chunk == layout.eos) + base + 1  # each document's stop
            taken = 0
            while taken < len(ends):
                cut = taken + int(np.searchsorted(ends[taken:], start + SHARD_TOKENS))  # the first end far enough
                if cut >= len(ends):
                    rows += len(ends) - taken
                    break
                rows += cut + 1 - taken
                close(int(ends[cut]))
                taken = cut + 1
        if start < total:  # the documents since the last cut, and the tokens after the last eos
            rows += int(_read(f, (total - 1) * dtype.itemsize, 1, dtype)[0] != layout.eos)
            close(total)
    return shards or [Shard(path, "tokens", 0, 0, 0, ordinal)]


def flat_rows(shard: Shard, rows: Sequence[int], layout: Pretokenized, files: Files) -> list[np.ndarray]:
    """Documents `rows` of a flat token file's shard as token arrays (record_ids): the shard's tokens
    read and cut at its eos ids again."""
    dtype = np.dtype(layout.dtype)
    with files.mapped(shard.file, shard.size, shard.version) as f:
        tokens = _read(f, shard.start * dtype.itemsize, shard.stop - shard.start, dtype)
    stops = np.flatnonzero(tokens == layout.eos) + 1
    if not len(stops) or stops[-1] != len(tokens):
        stops = np.append(stops, len(tokens))
    if len(stops) != shard.rows:
        raise BadFile(
            f"has {len(stops)} documents in the tokens from offset {shard.start}, the index counted "
            f"{shard.rows}: was the file changed while the job ran?"
        )
    starts = np.concatenate([[0], stops[:-1]])
    return [
        _checked(tokens[starts[r] : stops[r]], layout.vocab, f"document {r} of the shard", shard.start + int(starts[r]))
        for r in rows
    ]
