"""Read source files: index them into shards (at startup) and stream one shard (in a worker).

A shard is a unit of the source's order: one parquet row group, one Arrow record batch, a
run of JSON lines, or a run of WebDataset-style samples of a tar file. A worker reads it in
slices of about `Shard.slice_rows` rows (about SLICE_BYTES of the column, from the file's
metadata, so the same for every run; omniload.order.Slicing says which rows) and holds one
slice of a shard at a time, whatever the row-group size. The index counts rows from file metadata (parquet footer,
Arrow IPC
footer) or, for JSON lines, one pass over the file that also records byte offsets so plain
files can be split; a gzipped file is one shard. Values are strings (to be tokenized) or
integer arrays (an already tokenized list<int> column, used as is). A source with images
(an `image` column, or a tar file) yields `(text, [encoded image bytes, ...])` pairs instead.

A tar file's samples are its members grouped by key, WebDataset's way: `dir/KEY.jpg`,
`dir/KEY.txt` (or `dir/KEY.json` holding the text under the source's column) and further
images `dir/KEY.1.png`... make one sample; a sample's files are adjacent in the archive.
"""

from __future__ import annotations

import dataclasses
import gzip
import tarfile
from collections.abc import Iterator
from typing import IO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from omniload.formats.lane_config import Pretokenized
from omniload.formats.records import ids_fit_uint16
from omniload.formats.shards import TOKEN_FILES, BadFile, Shard, gzipped, part_name, slice_rows_for
from omniload.storage.files import Files
from omniload.storage.objects import BLOCK, StoreError
from omniload.storage.urls import is_remote
from omniload.workers.token_files import (
    VOCAB_FROM,
    check_tokens,
    flat_rows,
    index_flat,
    index_megatron,
    megatron_rows,
)

LOCAL = Files()  # local paths need no state: one for every caller that reads local files only
JSONL_SHARD_ROWS = 4096
TAR_SHARD_ROWS = 1024
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm")
_TEXT_SUFFIXES = ("txt", "text")
_READ_BUFFER = 256 << 10  # parquet: read column chunks through a buffer, not whole


def use_system_allocator() -> None:
    """Arrow's default allocator (jemalloc) keeps freed pages for reuse; the system one gives
    them back, so a process's memory follows the shard it holds now. Call at process start."""
    pa.set_memory_pool(pa.system_memory_pool())


# What reading a file's data can raise when the data is at fault (not the reader): a value of
# the wrong type or range, bytes that do not decode, a truncated or unreadable file.
DATA_ERRORS = (ValueError, TypeError, OverflowError, KeyError, IndexError, EOFError, OSError, pa.ArrowException)


def index_file(
    path: str,
    fmt: str,
    column: str,
    first_ordinal: int,
    image: str | None = None,
    files: Files = LOCAL,
    pretokenized: Pretokenized | None = None,
    values: str = "text",
) -> list[Shard]:
    """Shards of one file (`image`: the column of encoded images, if any; `values`: what the
    column must hold: text (or token ids), tokens (token ids), chat (lists of messages)); raises
    BadFile naming the problem. An object in a store: its shards record its size and version."""
    if image is not None and fmt not in ("parquet", "arrow"):
        raise BadFile(
            f"image={image} needs parquet or Arrow files (a {fmt} file has no columns); "
            "images in a .tar file are its image members"
        )
    try:
        if fmt == "parquet":
            shards = _index_parquet(path, _columns(column, image), first_ordinal, files, values)
        elif fmt == "arrow":
            shards = _index_arrow(path, _columns(column, image), first_ordinal, files, values)
        elif fmt == "tar":
            shards = _index_tar(path, column, first_ordinal, files)
        elif fmt == "megatron":
            shards = index_megatron(path, first_ordinal, files)
        elif fmt == "tokens":
            shards = index_flat(path, pretokenized or Pretokenized(), first_ordinal, files)
        else:
            shards = _index_jsonl(path, column, first_ordinal, files, values)
    except (BadFile, StoreError):  # a store's failure is not the file's: it never makes a file "bad"
        raise
    except (pa.ArrowException, OSError, EOFError, ValueError, tarfile.TarError) as exc:
        raise BadFile(f"not a valid {fmt} file: {exc}") from None
    if not is_remote(path):
        return shards
    obj = files.remote(path).obj  # opened while indexing: its size and version are known
    return [dataclasses.replace(s, size=obj.size or 0, version=obj.version) for s in shards]


def _columns(column: str, image: str | None) -> tuple[str, ...]:
    return (column,) if image is None else (column, image)


def _resolve(columns: tuple[str, ...], names: list[str]) -> tuple[str, ...]:
    """The columns with "a|b" (a chat source's messages or conversations) made the first of them
    the file has (the first named, if none)."""
    if "|" not in columns[0]:
        return columns
    choices = columns[0].split("|")
    return (next((c for c in choices if c in names), choices[0]), *columns[1:])


def _check_columns(schema: pa.Schema, columns: tuple[str, ...], values: str = "text") -> tuple[str, ...]:
    """The columns, resolved (_resolve); BadFile when the file lacks one or its type is wrong."""
    wanted = columns
    columns = _resolve(columns, schema.names)
    for column, asked in zip(columns, wanted):
        if column not in schema.names:
            option = "tokens" if values == "tokens" else "column" if column == columns[0] else "image"
            names = " or ".join(f"'{c}'" for c in asked.split("|"))
            raise BadFile(f"no column {names} (columns: {', '.join(schema.names)}); pick one with {option}=NAME")
    kind = schema.field(columns[0]).type
    if values == "tokens" and not _is_int_list(kind):
        raise BadFile(f"column '{columns[0]}' has type {kind}; tokens= needs a list of integer token ids")
    if values == "chat":
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            raise BadFile(f"column '{columns[0]}' has type {kind}; kind=chat needs a list of messages")
        return columns
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_int_list(kind)):
        raise BadFile(f"column '{columns[0]}' has type {kind}; expected text or a list of token ids")
    if len(columns) > 1 and _is_int_list(kind):
        raise BadFile(
            f"column '{columns[0]}' holds token ids; with image= the text column must be text, "
            "for the placeholders to go where it says <image>"
        )
    if len(columns) > 1 and not _is_image_type(schema.field(columns[1]).type):
        raise BadFile(
            f"image column '{columns[1]}' has type {schema.field(columns[1]).type}; expected binary "
            "(encoded JPEG/PNG...), a struct with a 'bytes' field (Hugging Face Image), or a list of those"
        )
    return columns


def _is_image_type(kind: pa.DataType) -> bool:
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind = kind.value_type
    if pa.types.is_struct(kind):
        return kind.get_field_index("bytes") >= 0 and _is_image_type(kind.field("bytes").type)
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _is_int_list(kind: pa.DataType) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)


def _index_parquet(
    path: str, columns: tuple[str, ...], ordinal: int, files: Files, values: str = "text"
) -> list[Shard]:
    meta = pq.ParquetFile(files.source(path))
    columns = _check_columns(meta.schema_arrow, columns, values)
    leaves = [
        j for j in range(meta.metadata.num_columns) if meta.metadata.schema.column(j).path.split(".")[0] in columns
    ]
    shards = []
    for i in range(meta.num_row_groups):
        group = meta.metadata.row_group(i)
        size = sum(group.column(j).total_uncompressed_size for j in leaves)
        shards.append(
            Shard(path, "parquet", i, i + 1, group.num_rows, ordinal, slice_rows=slice_rows_for(group.num_rows, size))
        )
        ordinal += group.num_rows
    return shards


def _index_arrow(path: str, columns: tuple[str, ...], ordinal: int, files: Files, values: str = "text") -> list[Shard]:
    def nbytes(batch: pa.RecordBatch) -> int:
        return sum(batch.column(c).nbytes for c in columns)

    try:
        with ipc.open_file(files.source(path)) as reader:
            columns = _check_columns(reader.schema, columns, values)
            shards = []
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)  # reads the batch header only (memory-mapped body)
                shards.append(
                    Shard(
                        path,
                        "arrow",
                        i,
                        i + 1,
                        batch.num_rows,
                        ordinal,
                        slice_rows=slice_rows_for(batch.num_rows, nbytes(batch)),
                    )
                )
                ordinal += batch.num_rows
            return shards
    except pa.ArrowInvalid:
        pass  # not the IPC file format; the streaming format (e.g. Hugging Face datasets) has no footer
    with files.mapped(path) as source, ipc.open_stream(source) as reader:
        columns = _check_columns(reader.schema, columns, values)
        rows = size = 0
        for batch in reader:
            rows, size = rows + batch.num_rows, size + nbytes(batch)
    return [Shard(path, "arrow-stream", 0, 0, rows, ordinal, slice_rows=slice_rows_for(rows, size))]


def _open_text(path: str, files: Files, size: int = 0, version: str = "") -> IO[bytes]:
    raw = files.open(path, size, version)
    return gzip.open(raw, "rb") if gzipped(path) else raw  # type: ignore[return-value]


def _index_jsonl(path: str, column: str, ordinal: int, files: Files, values: str = "text") -> list[Shard]:
    compressed = gzipped(path)
    shards: list[Shard] = []
    rows = offset = shard_offset = shard_start = 0

    def shard_to(stop: int) -> Shard:
        return Shard(
            path,
            "jsonl",
            shard_start,
            stop,
            stop - shard_start,
            ordinal + shard_start,
            shard_offset,
            slice_rows=slice_rows_for(stop - shard_start, offset - shard_offset),
        )

    with _open_text(path, files) as f:
        for line in f:
            if line.strip():
                if rows == 0:
                    value = _json_field(line, column, "line 1")
                    if values == "chat" and not isinstance(value, list):
                        raise BadFile(
                            f"line 1: '{column}' holds {type(value).__name__}; kind=chat needs a list of messages"
                        )
                    if values == "tokens" and not (isinstance(value, list) and all(isinstance(v, int) for v in value)):
                        raise BadFile(
                            f"line 1: '{column}' holds {type(value).__name__}; tokens= needs a list of token ids"
                        )
                if not compressed and rows - shard_start == JSONL_SHARD_ROWS:
                    shards.append(shard_to(rows))
                    shard_start, shard_offset = rows, offset
                rows += 1
            offset += len(line)
    if rows > shard_start or not shards:
        shards.append(shard_to(rows))
    return shards


def _json_field(data: bytes, column: str, where: str) -> object:
    """The `column` field of a JSON object (of "a|b", the first it has); BadFile naming `where` otherwise."""
    try:
        row = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BadFile(f"{where} is not valid JSON: {exc}") from None
    if isinstance(row, dict):
        for name in column.split("|"):
            if name in row:
                return row[name]
    names = " or ".join(f"'{c}'" for c in column.split("|"))
    raise BadFile(f"{where} has no key {names}; pick the field with column=NAME")


def read_shard(
    shard: Shard, column: str, image: str | None = None, files: Files = LOCAL, pretokenized: Pretokenized | None = None
) -> list:
    """All values of a shard's column (with `image`: (text, images) pairs), in file order;
    raises BadFile naming the problem."""
    if shard.format in ("jsonl", "tar", *TOKEN_FILES):
        return [
            value
            for part in iter_slices(
                dataclasses.replace(shard, slice_rows=0), column, files=files, pretokenized=pretokenized
            )
            for value in part
        ]
    columns = _columns(column, image)
    try:
        if shard.format == "parquet":
            reader = pq.ParquetFile(_source(shard, files))
            columns = _resolve(columns, reader.schema_arrow.names)
            table = reader.read_row_group(shard.start, columns=list(columns))
        elif shard.format == "arrow":
            with ipc.open_file(_source(shard, files)) as reader:
                table = pa.Table.from_batches([reader.get_batch(shard.start)])
        else:
            with files.mapped(shard.file, shard.size, shard.version) as source, ipc.open_stream(source) as reader:
                table = reader.read_all()
        values = _select(table, columns)
    except (BadFile, StoreError):
        raise
    except (pa.ArrowException, OSError, EOFError, KeyError) as exc:
        raise BadFile(f"cannot read {shard.format} shard {shard.start}: {exc}") from None
    if len(values) != shard.rows:
        raise BadFile(
            f"has {len(values)} rows in shard {shard.start}, the index counted {shard.rows}: "
            "was the file changed while the job ran?"
        )
    return _to_values(values)


def _select(batch: pa.RecordBatch | pa.Table, columns: tuple[str, ...]) -> pa.Array:
    """The text column, or with an image column both as one struct array (so slices cut both alike)."""
    arrays = [batch.column(c) for c in _resolve(columns, batch.schema.names)]
    arrays = [a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in arrays]
    return arrays[0] if len(arrays) == 1 else pa.StructArray.from_arrays(arrays, ["text", "image"])


def _to_values(values: pa.Array | pa.ChunkedArray) -> list:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_struct(values.type):  # text and image columns (see _select)
        text, images = values.flatten()
        return list(zip(_to_values(text), _image_lists(images)))
    if _is_int_list(values.type):
        # a sliced list array's offsets index its whole child: take only the slice's part, and
        # copy it, so the rows' arrays never pin an Arrow buffer (or a memory-mapped file)
        offsets = values.offsets.to_numpy()
        child = values.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        flat = child.to_numpy(zero_copy_only=False)
        flat = flat.astype(np.uint16 if ids_fit_uint16(flat.dtype) else np.int32)  # what a record keeps
        offsets = offsets - offsets[0]
        return [flat[offsets[i] : offsets[i + 1]] for i in range(len(values))]
    return values.to_pylist()


def _image_lists(images: pa.Array) -> list[list[bytes]]:
    """Each row's encoded images: a binary value, a struct's 'bytes', or a list of either."""
    kind = images.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        offsets = images.offsets.to_numpy()
        flat = _image_lists(images.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])))
        offsets = offsets - offsets[0]
        return [[b for one in flat[offsets[i] : offsets[i + 1]] for b in one] for i in range(len(images))]
    if pa.types.is_struct(kind):
        images = images.flatten()[kind.get_field_index("bytes")]
    return [[] if b is None else [b] for b in images.to_pylist()]


def iter_slices(
    shard: Shard,
    column: str,
    first: int = 0,
    image: str | None = None,
    files: Files = LOCAL,
    pretokenized: Pretokenized | None = None,
) -> Iterator[list]:
    """A shard's values slice by slice (order.Slicing: `shard.slicing.members(j)` of slice j), from
    slice `first` on, so the caller holds one slice, never the shard. A strided shard's slices
    each read the shard anew (any slice can come first); the others are read on from the
    shard's first row, as their format reads. With `image` (and always for tar), each value is a (text, images) pair.
    With `pretokenized`, token files are read by its layout and ids checked against its vocabulary.
    Raises BadFile naming the problem, also part-way through the shard."""
    if shard.rows == 0:
        return
    slicing = shard.slicing
    j, columns = first, _columns(column, image)
    chunks: Iterator[list]
    try:
        if shard.strided:
            chunks = (
                _strided_slice(shard, columns, slicing.count, k, files, pretokenized)
                for k in range(first, slicing.count)
            )
        else:  # read on from the file's start: slice `first` starts at row first * size
            size = slicing.size or shard.rows
            rows: Iterator[object] = (
                _jsonl_values(shard, column, 1, first * size, files)
                if shard.format == "jsonl"
                else _tar_values(shard, column, first * size, files)
            )
            chunks = _runs(rows, size)
        for values in chunks:
            # each slice, not the total at the end: a lane stops reading a shard at its last turn
            if len(values) != len(slicing.members(j)):
                raise BadFile(
                    f"{part_name(shard.format, shard.start)}: slice {j} has {len(values)} rows, the "
                    f"index expects {len(slicing.members(j))}: was the file changed while the job ran?"
                )
            if pretokenized is not None and pretokenized.vocab is not None and shard.format not in TOKEN_FILES:
                _check_vocab(shard, values, slicing.members(j), pretokenized.vocab)
            j += 1
            yield values
    except (BadFile, StoreError):
        raise
    except (pa.ArrowException, OSError, EOFError, KeyError, tarfile.TarError) as exc:
        raise BadFile(f"cannot read {part_name(shard.format, shard.start)}: {exc}") from None
    if j < slicing.count:
        raise BadFile(
            f"{part_name(shard.format, shard.start)} ran out of rows before slice {j} of {slicing.count}, "
            f"the index counted {shard.rows}: was the file changed while the job ran?"
        )


def warm(shard: Shard, column: str, image: str | None, files: Files) -> None:
    """Start fetching the bytes a remote shard's first slice reads, in the background: a
    parquet row group's column chunks (its footer read first), else the shard's first blocks."""
    if not is_remote(shard.file):
        return
    files.in_background(lambda: _warm(shard, _columns(column, image), files))


def _warm(shard: Shard, columns: tuple[str, ...], files: Files) -> None:
    if shard.format == "megatron":  # where a shard's documents lie is in the .idx: its slices fetch them
        return
    file = files.remote(shard.file, shard.size, shard.version)
    if shard.format != "parquet":
        file.warm(shard.byte_offset, shard.byte_offset + 2 * BLOCK)
        return
    parquet = pq.ParquetFile(file)
    meta, columns = parquet.metadata, _resolve(columns, parquet.schema_arrow.names)
    group = meta.row_group(shard.start)
    chunks = [group.column(j) for j in range(group.num_columns) if meta.schema.column(j).path.split(".")[0] in columns]
    starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks]
    file.warm(min(starts), max(s + c.total_compressed_size for s, c in zip(starts, chunks)))


def _check_vocab(shard: Shard, values: list, rows: range, vocab: int) -> None:
    """BadFile naming the first row of a token-id column with an id not below `vocab`."""
    for value, row in zip(values, rows):
        bad = check_tokens(value, vocab) if isinstance(value, np.ndarray) else None
        if bad is not None:
            raise BadFile(
                f"{part_name(shard.format, shard.start)}, row {row}: token id {int(value[bad])} at position "
                f"{bad} is not below the vocabulary size {vocab} ({VOCAB_FROM})"
            )


def _strided_slice(
    shard: Shard,
    columns: tuple[str, ...],
    step: int,
    j: int,
    files: Files = LOCAL,
    pretokenized: Pretokenized | None = None,
) -> list:
    """Rows j, j + step, j + 2 step... of the shard, read from its start: a parquet reader
    cannot start part-way into a row group, and one kept open between slices holds several MB
    (pages, dictionary, buffers), more than a slice. A token file's documents are read each
    where it lies (workers/token_files.py)."""
    layout = pretokenized or Pretokenized()
    if shard.format == "megatron":
        return megatron_rows(shard, range(j, shard.rows, step), files, layout.vocab)
    if shard.format == "tokens":
        return flat_rows(shard, range(j, shard.rows, step), layout, files)
    if shard.format == "jsonl":
        return list(_jsonl_values(shard, columns[0], step, j, files))
    pieces, offset = [], 0
    for chunk in _arrow_chunks(shard, columns, shard.slice_rows or shard.rows, files):
        if step == 1:
            pieces.append(chunk)
        elif rows := [chunk.slice(i, 1) for i in range((j - offset) % step, len(chunk), step)]:
            # concatenated (a copy) before the next chunk: a slice is a view that keeps its
            # whole chunk alive, and the pass must hold one chunk, not the shard. One-row slices,
            # not Array.take: importing pyarrow.compute costs a worker some 15 MB.
            pieces.append(pa.concat_arrays(rows))
        offset += len(chunk)
    if not pieces:
        return []
    return _to_values(pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces))


def _arrow_chunks(shard: Shard, columns: tuple[str, ...], size: int, files: Files = LOCAL) -> Iterator[pa.Array]:
    """The column's values in file order, in chunks of about `size` rows (a stream's batches as
    they come), each read or mapped when it is due and let go with it."""
    if shard.format == "parquet":
        reader = pq.ParquetFile(_source(shard, files), buffer_size=_READ_BUFFER, pre_buffer=False)
        columns = _resolve(columns, reader.schema_arrow.names)
        try:
            for batch in reader.iter_batches(
                batch_size=size, row_groups=[shard.start], columns=list(columns), use_threads=False
            ):
                yield _select(batch, columns)
        finally:
            reader.close()
    elif shard.format == "arrow":
        for offset in range(0, shard.rows, size):
            with files.mapped(shard.file, shard.size, shard.version) as source, ipc.open_file(source) as reader:
                yield _select(reader.get_batch(shard.start), columns).slice(offset, size)
    else:
        with files.mapped(shard.file, shard.size, shard.version) as source, ipc.open_stream(source) as reader:
            for batch in reader:
                yield _select(batch, columns)


def _source(shard: Shard, files: Files) -> str | object:
    """What pyarrow opens for a shard's file: its path, or the remote object as listed."""
    return files.source(shard.file, shard.size, shard.version)


def _runs(values: Iterator, size: int) -> Iterator[list]:
    """The values in lists of `size` (the last fewer)."""
    run: list = []
    for value in values:
        run.append(value)
        if len(run) == size:
            yield run
            run = []
    if run:
        yield run


def _jsonl_values(shard: Shard, column: str, step: int = 1, j: int = 0, files: Files = LOCAL) -> Iterator[object]:
    """The values of rows j, j + step, j + 2 step... of a JSON lines shard; only those lines are
    parsed."""
    with _open_text(shard.file, files, shard.size, shard.version) as f:
        f.seek(shard.byte_offset)  # a gzipped file is one shard, from offset 0
        number, taken = shard.start, 0
        for line in f:
            if taken == shard.rows:
                break
            if not line.strip():
                continue
            number += 1
            taken += 1
            if taken - 1 < j or (taken - 1 - j) % step:
                continue
            value = _json_field(line, column, f"line {number}")
            ids = isinstance(value, list) and not (value and isinstance(value[0], dict))  # not a conversation
            yield np.asarray(value, dtype=np.int32) if ids else value


def _sample_key(name: str) -> tuple[str, str]:
    """(key, suffix) of a tar member, WebDataset's way: the key is the path up to the first dot
    of the file name, the suffix what follows its last dot, lowercased."""
    folder, _, base = name.rpartition("/")
    stem, _, rest = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), rest.rpartition(".")[2].lower()


def _tar_samples(
    path: str, offset: int, compressed: bool, files: Files, size: int = 0, version: str = ""
) -> Iterator[tuple[int, str, list[tuple[str, bytes | None]]]]:
    """(header offset, key, [(suffix, data), ...]) of each sample from byte `offset` on (0 for a
    compressed file, read as a stream); data is read for text and image members only."""
    with files.open(path, size, version) as raw:
        raw.seek(offset)
        archive = tarfile.open(fileobj=raw, mode="r|*" if compressed else "r:")
        with archive:
            key: str | None = None
            start, members = 0, list[tuple[str, bytes | None]]()
            for info in archive:
                if not info.isfile():
                    continue
                name_key, suffix = _sample_key(info.name)
                if name_key != key:
                    if key is not None:
                        yield start, key, members
                    key, start, members = name_key, info.offset, []
                wanted = suffix in IMAGE_SUFFIXES or suffix in _TEXT_SUFFIXES or suffix == "json"
                member = archive.extractfile(info) if wanted else None
                data = member.read() if member is not None else None
                members.append((suffix, data))
            if key is not None:
                yield start, key, members


def _compressed(path: str, files: Files, size: int = 0, version: str = "") -> bool:
    with files.open(path, size, version) as f:
        return f.read(2) == b"\x1f\x8b"


def _tar_value(key: str, members: list[tuple[str, bytes | None]], column: str) -> tuple[str, list[bytes]]:
    """A sample's (text, images): its .txt, else its .json's `column`; its images in member order."""
    raw = next((data for suffix, data in members if suffix in _TEXT_SUFFIXES), None)
    if raw is None:
        meta = next((data for suffix, data in members if suffix == "json"), None)
        if meta is None:
            raise BadFile(f"sample '{key}' has no {key}.txt and no {key}.json for its text")
        text = _json_field(meta, column, f"{key}.json")
    else:
        text = raw.decode("utf-8", errors="replace")
    return text, [data for suffix, data in members if suffix in IMAGE_SUFFIXES and data is not None]  # type: ignore[return-value]  # a .json text field is whatever the file holds, as before


def _index_tar(path: str, column: str, ordinal: int, files: Files) -> list[Shard]:
    """Runs of TAR_SHARD_ROWS samples; a compressed tar cannot be entered part-way: one shard."""
    compressed = _compressed(path, files)
    shards: list[Shard] = []
    rows = size = shard_start = shard_offset = 0

    def shard_to(stop: int) -> Shard:
        return Shard(
            path,
            "tar",
            shard_start,
            stop,
            stop - shard_start,
            ordinal + shard_start,
            shard_offset,
            slice_rows_for(stop - shard_start, size),
        )

    for offset, key, members in _tar_samples(path, 0, compressed, files):
        if rows == 0:
            _tar_value(key, members, column)  # a file of the wrong shape fails at startup
        if not compressed and rows - shard_start == TAR_SHARD_ROWS:
            shards.append(shard_to(rows))
            shard_start, shard_offset, size = rows, offset, 0
        rows += 1
        size += sum(len(data) for _, data in members if data is not None)
    if rows > shard_start or not shards:
        shards.append(shard_to(rows))
    return shards


def _tar_values(shard: Shard, column: str, first: int = 0, files: Files = LOCAL) -> Iterator[tuple[str, list[bytes]]]:
    """The shard's (text, images) values in file order, from its row `first` on."""
    seekable = not _compressed(shard.file, files, shard.size, shard.version)  # else read from the start (one shard)
    skip, taken = first + (0 if seekable else shard.start), first
    for _, key, members in _tar_samples(
        shard.file, shard.byte_offset if seekable else 0, not seekable, files, shard.size, shard.version
    ):
        if taken >= shard.rows:
            break
        if skip:
            skip -= 1
            continue
        taken += 1
        yield _tar_value(key, members, column)
