"""Read source files: index them into shards (at startup) and read one shard (in a worker).

A shard is a unit a worker reads whole: one parquet row group, one Arrow record batch, or a
run of JSON lines. The index counts rows from file metadata (parquet footer, Arrow IPC
footer) or, for JSON lines, one pass over the file that also records byte offsets so plain
files can be split; a gzipped file is one shard. Values are strings (to be tokenized) or
integer arrays (an already tokenized list<int> column, used as is).
"""
from __future__ import annotations

import gzip
from dataclasses import dataclass
from typing import IO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

JSONL_SHARD_ROWS = 4096
_SUFFIXES = {
    ".parquet": "parquet", ".pq": "parquet",
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
    ".jsonl.gz": "jsonl", ".json.gz": "jsonl", ".ndjson.gz": "jsonl",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
}


def use_system_allocator() -> None:
    """Arrow's default allocator (jemalloc) keeps freed pages for reuse; the system one gives
    them back, so a process's memory follows the shard it holds now. Call at process start."""
    pa.set_memory_pool(pa.system_memory_pool())


class BadFile(Exception):
    """A file that cannot be read as its format; the message says why."""


# What reading a file's data can raise when the data is at fault (not the reader): a value of
# the wrong type or range, bytes that do not decode, a truncated or unreadable file.
DATA_ERRORS = (ValueError, TypeError, OverflowError, KeyError, IndexError, EOFError, OSError, pa.ArrowException)


@dataclass(frozen=True, slots=True)
class Shard:
    file: str
    format: str  # parquet | jsonl | arrow | arrow-stream
    start: int  # first row group / record batch / line
    stop: int
    rows: int
    first_ordinal: int  # canonical index of the shard's first row within its source
    byte_offset: int = 0  # plain JSON lines: where line `start` begins


def part_name(fmt: str, start: int) -> str:
    """The part of its file a shard starting at `start` is, in the file format's words."""
    if fmt == "jsonl":
        return f"the lines from {start + 1}"
    if fmt == "parquet":
        return f"row group {start}"
    return f"record batch {start}" if fmt == "arrow" else "the Arrow stream"


def detect_format(path: str) -> str | None:
    name = path.lower()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return _SUFFIXES[suffix]
    return None


def index_file(path: str, fmt: str, column: str, first_ordinal: int) -> list[Shard]:
    """Shards of one file; raises BadFile naming the problem."""
    try:
        if fmt == "parquet":
            return _index_parquet(path, column, first_ordinal)
        if fmt == "arrow":
            return _index_arrow(path, column, first_ordinal)
        return _index_jsonl(path, column, first_ordinal)
    except BadFile:
        raise
    except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
        raise BadFile(f"not a valid {fmt} file: {exc}") from None


def _check_column(schema: pa.Schema, column: str) -> None:
    if column not in schema.names:
        raise BadFile(f"no column '{column}' (columns: {', '.join(schema.names)}); pick one with column=NAME")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_int_list(kind)):
        raise BadFile(f"column '{column}' has type {kind}; expected text or a list of token ids")


def _is_int_list(kind: pa.DataType) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)


def _index_parquet(path: str, column: str, ordinal: int) -> list[Shard]:
    meta = pq.ParquetFile(path)
    _check_column(meta.schema_arrow, column)
    shards = []
    for i in range(meta.num_row_groups):
        rows = meta.metadata.row_group(i).num_rows
        shards.append(Shard(path, "parquet", i, i + 1, rows, ordinal))
        ordinal += rows
    return shards


def _index_arrow(path: str, column: str, ordinal: int) -> list[Shard]:
    try:
        with ipc.open_file(path) as reader:
            _check_column(reader.schema, column)
            shards = []
            for i in range(reader.num_record_batches):
                rows = reader.get_batch(i).num_rows  # reads the batch header only (memory-mapped body)
                shards.append(Shard(path, "arrow", i, i + 1, rows, ordinal))
                ordinal += rows
            return shards
    except pa.ArrowInvalid:
        pass  # not the IPC file format; the streaming format (e.g. Hugging Face datasets) has no footer
    with pa.memory_map(path) as source, ipc.open_stream(source) as reader:
        _check_column(reader.schema, column)
        rows = sum(batch.num_rows for batch in reader)
    return [Shard(path, "arrow-stream", 0, 0, rows, ordinal)]


def _open_text(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _index_jsonl(path: str, column: str, ordinal: int) -> list[Shard]:
    compressed = path.endswith(".gz")
    shards: list[Shard] = []
    rows = offset = shard_offset = shard_start = 0
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                if rows == 0:
                    _check_json_row(line, column, 1)
                if not compressed and rows - shard_start == JSONL_SHARD_ROWS:
                    shards.append(Shard(path, "jsonl", shard_start, rows, rows - shard_start,
                                        ordinal + shard_start, shard_offset))
                    shard_start, shard_offset = rows, offset
                rows += 1
            offset += len(line)
    if rows > shard_start or not shards:
        shards.append(Shard(path, "jsonl", shard_start, rows, rows - shard_start, ordinal + shard_start, shard_offset))
    return shards


def _check_json_row(line: bytes, column: str, number: int) -> object:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise BadFile(f"line {number} is not valid JSON: {exc}") from None
    if not isinstance(row, dict) or column not in row:
        raise BadFile(f"line {number} has no key '{column}'; pick the text field with column=NAME")
    return row[column]


def read_shard(shard: Shard, column: str) -> list[str] | list[np.ndarray]:
    """All values of a shard's column, in file order; raises BadFile naming the problem."""
    try:
        if shard.format == "jsonl":
            return _read_jsonl(shard, column)
        if shard.format == "parquet":
            values = pq.ParquetFile(shard.file).read_row_group(shard.start, columns=[column]).column(0)
        elif shard.format == "arrow":
            with ipc.open_file(shard.file) as reader:
                values = reader.get_batch(shard.start).column(column)
        else:
            with pa.memory_map(shard.file) as source, ipc.open_stream(source) as reader:
                values = reader.read_all().column(column)
    except BadFile:
        raise
    except (pa.ArrowException, OSError, EOFError, KeyError) as exc:
        raise BadFile(f"cannot read {shard.format} shard {shard.start}: {exc}") from None
    if len(values) != shard.rows:
        raise BadFile(f"has {len(values)} rows in shard {shard.start}, the index counted {shard.rows}: "
                      "was the file changed while the job ran?")
    return _to_values(values)


def _to_values(values: pa.Array | pa.ChunkedArray) -> list[str] | list[np.ndarray]:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if _is_int_list(values.type):
        offsets = values.offsets.to_numpy()
        flat = values.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
        return [flat[offsets[i] : offsets[i + 1]] for i in range(len(values))]
    return values.to_pylist()


def _read_jsonl(shard: Shard, column: str) -> list[str] | list[np.ndarray]:
    values = []
    with _open_text(shard.file) as f:
        f.seek(shard.byte_offset) if not shard.file.endswith(".gz") else None
        number = shard.start if not shard.file.endswith(".gz") else 0
        for line in f:
            if len(values) == shard.rows:
                break
            if not line.strip():
                continue
            number += 1
            if number <= shard.start:
                continue
            value = _check_json_row(line, column, number)
            values.append(np.asarray(value, dtype=np.int32) if isinstance(value, list) else value)
    if len(values) != shard.rows:
        raise BadFile(f"has {len(values)} rows from line {shard.start + 1}, the index counted {shard.rows}: "
                      "was the file changed while the job ran?")
    return values
