"""Small corpora for the tests: deterministic documents in every supported format."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omniload.formats.shards import Shard


def documents(n: int, seed: int, min_words: int = 2, max_words: int = 120) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        " ".join(f"w{seed}x{int(k)}" for k in rng.integers(0, 1000, rng.integers(min_words, max_words)))
        for _ in range(n)
    ]


def write_parquet(path: Path, texts: list, column: str = "text", row_group_size: int = 50) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: texts}), path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, texts: list, column: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt") as f:
        for text in texts:
            f.write(json.dumps({column: text}) + "\n")
    return path


def write_arrow(path: Path, texts: list, column: str = "text", batch_rows: int = 40) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({column: texts})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for start in range(0, len(table), batch_rows):
            writer.write_batch(table.slice(start, batch_rows).to_batches()[0])
    return path


def image_color(ordinal: int, k: int) -> tuple[int, int, int]:
    """The solid colour of image k of sample `ordinal`: a test reads a sample's identity back from its pixels."""
    return ordinal % 256, (ordinal // 256) % 256, 40 * k + 3


def encoded_image(color: tuple[int, int, int], size: tuple[int, int], fmt: str = "PNG") -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format=fmt)
    return out.getvalue()


def image_samples(n: int, seed: int, max_images: int = 2, long_every: int = 0) -> list[tuple[str, list[bytes]]]:
    """(text, PNG images) samples; sample i's images are solid image_color(i, k), of varied sizes.
    Odd samples mark where their images go with <image>; every `long_every`-th has a long text."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        count = int(rng.integers(0, max_images + 1))
        images = [
            encoded_image(image_color(i, k), (int(rng.integers(8, 64)), int(rng.integers(8, 64)))) for k in range(count)
        ]
        words = " ".join(f"c{i}w{int(w)}" for w in rng.integers(0, 100, int(rng.integers(1, 6))))
        if long_every and i % long_every == 0:
            words = (words + " ") * 3
        text = " ".join([words] + ["<image>"] * count) if i % 2 else words
        samples.append((text, images))
    return samples


def write_image_parquet(path: Path, samples: list[tuple[str, list[bytes]]], row_group_size: int = 20) -> Path:
    """Text and a list<binary> image column."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {"text": [t for t, _ in samples], "image": pa.array([imgs for _, imgs in samples], pa.list_(pa.binary()))}
    )
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_image_tar(path: Path, samples: list[tuple[str, list[bytes]]], corrupt: set[int] = frozenset()) -> Path:
    """WebDataset-style: KEY.txt and KEY.png, KEY.1.png...; samples in `corrupt` get a truncated first image."""
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as archive:
        for i, (text, images) in enumerate(samples):
            members = [(f"s{i:05d}.txt", text.encode())]
            for k, data in enumerate(images):
                data = data[: len(data) // 3] if i in corrupt and k == 0 else data
                members.append((f"s{i:05d}.{k}.png" if k else f"s{i:05d}.png", data))
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return path


def make_mixed_corpus(root: Path) -> dict[str, str]:
    """Three sources in three formats (parquet, gzipped JSON lines, Arrow IPC); source name -> glob."""
    write_parquet(root / "web" / "a.parquet", documents(300, 1))
    write_parquet(root / "web" / "b.parquet", documents(200, 2))
    write_jsonl(root / "code" / "a.jsonl.gz", documents(250, 3), column="content")
    write_jsonl(root / "code" / "b.jsonl", documents(150, 4), column="content")
    write_arrow(root / "books" / "a.arrow", documents(60, 5, 200, 900))
    return {
        "web": str(root / "web" / "*.parquet"),
        "code": str(root / "code" / "*.jsonl*"),
        "books": str(root / "books" / "*.arrow"),
    }


def mixed_sources(corpus: dict[str, str], weights=(0.6, 0.3, 0.1)) -> list[dict]:
    return [
        {"name": "web", "path": corpus["web"], "weight": weights[0]},
        {"name": "code", "path": corpus["code"], "weight": weights[1], "column": "content"},
        {"name": "books", "path": corpus["books"], "weight": weights[2]},
    ]


def source_flags(sources: list[dict]) -> list[str]:
    """The `--source` flags of `omniload launch` that give these sources (mixed_sources' dicts)."""
    return [
        f"--source={s['name']}={s['path']},weight={s['weight']}" + (f",column={s['column']}" if "column" in s else "")
        for s in sources
    ]


def write_megatron(prefix: Path, documents: list[list[list[int]]], dtype: type = np.uint16) -> Path:
    """A Megatron indexed dataset PREFIX.bin + PREFIX.idx written by the MMIDIDX layout as
    documented (workers/token_files.py), without Megatron: each document a list of sequences
    of token ids. Returns the .bin."""
    codes = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    sequences = [np.asarray(seq, dtype=dtype) for doc in documents for seq in doc]
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * np.dtype(dtype).itemsize
    doc_index = np.concatenate([[0], np.cumsum([len(doc) for doc in documents])]).astype(np.int64)
    Path(f"{prefix}.bin").write_bytes(b"".join(s.tobytes() for s in sequences))
    header = b"MMIDIDX\x00\x00" + np.uint64(1).tobytes() + bytes([codes[dtype]])
    header += np.uint64(len(sequences)).tobytes() + np.uint64(len(doc_index)).tobytes()
    Path(f"{prefix}.idx").write_bytes(
        header + lengths.tobytes() + pointers[: len(sequences)].astype(np.int64).tobytes() + doc_index.tobytes()
    )
    return Path(f"{prefix}.bin")


def write_token_file(path: Path, documents: list[list[int]], eos: int, dtype: type = np.uint16) -> Path:
    """A flat token file as nanoGPT's prepare.py writes train.bin: every document followed by `eos`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.concatenate([np.asarray([*doc, eos], dtype=dtype) for doc in documents]).tofile(path)
    return path


def bucket_objects(n: int) -> list[Shard]:
    """n objects of a bucket, one shard each, as the catalog indexes a store's parquet files
    (sizes and 32-hex-digit ETags included): the catalog's columns at scale, without a store."""
    return [
        Shard(
            f"s3://bucket/corpus/part-{i:06d}.parquet",
            "parquet",
            0,
            1,
            1000 + i % 17,
            1000 * i,
            size=80_000 + i,
            version=hashlib.md5(str(i).encode()).hexdigest(),
        )
        for i in range(n)
    ]
