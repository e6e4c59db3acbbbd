"""What the coordinator knows of a source's files: their shards, and how to name a file's part
or tell its format. No pyarrow here: the coordinator never imports it (readers.py, which
reads the files, runs in the workers and in the indexing child, coordinator/catalog.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from omniload.order import Slicing

_SUFFIXES = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".jsonl.gz": "jsonl",
    ".json.gz": "jsonl",
    ".ndjson.gz": "jsonl",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".tar": "tar",
    ".tar.gz": "tar",
    ".tgz": "tar",
    ".bin": "megatron",  # a flat token file (nanoGPT's train.bin) says format=tokens
}
TOKEN_FILES = ("megatron", "tokens")  # formats of token ids, read without a tokenizer
# column bytes per slice: a lane holds about this much per shard it reads (--shard-interleave of them)
SLICE_BYTES = 256 << 10
MAX_SLICES = 16  # per shard: each slice of a strided shard reads (decodes) the whole shard


class BadFile(Exception):
    """A file that cannot be read as its format; the message says why."""


@dataclass(frozen=True, slots=True)
class Shard:
    file: str
    format: str  # parquet | jsonl | arrow | arrow-stream | tar | megatron | tokens
    start: int  # first row group / record batch / line / document (megatron) / token (tokens)
    stop: int
    rows: int
    first_ordinal: int  # canonical index of the shard's first row within its source
    # plain JSON lines: where line `start` begins; plain tar: sample `start`'s first header; tokens: token `start`
    byte_offset: int = 0
    slice_rows: int = 0  # rows read at once (0: the whole shard); decides the row order (order.row_permutation)
    size: int = 0  # an object in a store: its bytes and version (ETag) when indexed, checked when read
    version: str = ""

    @property
    def strided(self) -> bool:
        """Whether its slices take every count-th row (order.Slicing), reading the shard once
        per slice. Parquet, Arrow and plain JSON lines shards are: a pass decodes or scans the
        shard. A compressed JSON lines file would be decompressed once per slice, and a pass
        over a tar shard reads every sample's images: those take runs of neighbouring rows."""
        if self.format == "jsonl":
            return not gzipped(self.file)
        return self.format != "tar"

    @property
    def slicing(self) -> Slicing:
        return Slicing(self.rows, self.slice_rows, self.strided)


def part_name(fmt: str, start: int) -> str:
    """The part of its file a shard starting at `start` is, in the file format's words."""
    if fmt == "jsonl":
        return f"the lines from {start + 1}"
    if fmt == "tar":
        return f"the samples from {start + 1}"
    if fmt == "parquet":
        return f"row group {start}"
    if fmt == "megatron":
        return f"the documents from {start}"
    if fmt == "tokens":
        return f"the tokens from offset {start}"
    return f"record batch {start}" if fmt == "arrow" else "the Arrow stream"


def gzipped(path: str) -> bool:
    """Whether a JSON lines file is read through gzip (one shard, read from its start)."""
    return path.lower().endswith(".gz")


def detect_format(path: str) -> str | None:
    name = path.lower()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return _SUFFIXES[suffix]
    return None


def slice_rows_for(rows: int, size: int) -> int:
    """Rows per slice for a shard of `rows` rows whose column takes `size` bytes: about
    SLICE_BYTES, or more for a shard so large it would have more than MAX_SLICES slices."""
    if rows <= 0 or size <= SLICE_BYTES:
        return rows
    return max(1, -(-rows // MAX_SLICES), rows * SLICE_BYTES // size)
