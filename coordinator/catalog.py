"""Find and index every source's files at startup, so bad input fails before any worker runs."""
from __future__ import annotations

import glob
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import orjson

from omniload.errors import ConfigError
from omniload.order import MAX_ORDINAL
from omniload.spec import IMAGE_FIELDS, RUNTIME_FIELDS, Source, Spec
from omniload.workers.images import ImageConfig, load_image_transform, require_pillow
from omniload.workers.readers import BadFile, Shard, detect_format, index_file
from omniload.workers.transforms import load_transform

log = logging.getLogger("omniload")


@dataclass(frozen=True, slots=True)
class SourceCatalog:
    index: int
    name: str
    column: str
    tokenizer: str
    shards: tuple[Shard, ...]
    rows: int
    epochs: int  # passes over this source; 0: forever
    image_column: str | None = None
    images: ImageConfig | None = None  # set when its samples carry images


def image_config(spec: Spec) -> ImageConfig | None:
    """How the job decodes images; None for a text-only job."""
    if not spec.has_images:
        return None
    height, width = spec.image_hw
    return ImageConfig(height, width, spec.image_token, spec.tokens_per_image, spec.image_transform)


def build_catalog(spec: Spec) -> list[SourceCatalog]:
    return [_index_source(i, source, spec) for i, source in enumerate(spec.sources)]


def _index_source(index: int, source: Source, spec: Spec) -> SourceCatalog:
    tokenizer = source.tokenizer or spec.tokenizer
    try:
        load_transform(tokenizer)
    except ConfigError as exc:
        raise ConfigError(f"source '{source.name}': {exc}") from None
    images = image_config(spec) if source.has_images else None
    if images is not None:
        require_pillow(source.name)
        load_image_transform(images)  # a bad --image-transform fails here, not in every worker
    shards: list[Shard] = []
    rows = 0
    for path in _match_files(source):
        fmt = source.format if source.format != "auto" else detect_format(path)
        if fmt is None:
            raise ConfigError(f"source '{source.name}': cannot tell the format of {path!r} from its name; "
                              "add format=parquet|jsonl|arrow|tar to the source")
        try:
            file_shards = index_file(path, fmt, source.column, rows, source.image)
        except BadFile as exc:
            if spec.on_bad_file == "stop":
                raise ConfigError(f"source '{source.name}': {path}: {exc} (the job stops on a bad file; "
                                  "--on-bad-file skip skips it instead)") from None
            log.warning("source '%s': skipping %s: %s", source.name, path, exc)
            continue
        if fmt == "tar" and images is None:  # the glob did not say .tar, the files do
            raise ConfigError(f"source '{source.name}': {path} is a tar file: give format=tar to the source "
                              "(and --image-token) so that its images are decoded")
        shards.extend(file_shards)
        rows += sum(s.rows for s in file_shards)
    if rows == 0:
        raise ConfigError(f"source '{source.name}': its files hold no rows")
    if rows >= MAX_ORDINAL:
        raise ConfigError(f"source '{source.name}': {rows} rows exceed the limit of {MAX_ORDINAL}; split the source")
    epochs = spec.epochs if source.epochs is None else source.epochs
    return SourceCatalog(index, source.name, source.column, tokenizer, tuple(shards), rows, epochs,
                         source.image, images)


def _match_files(source: Source) -> list[str]:
    files: set[str] = set()
    for pattern in source.path:
        matched = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)]
        if not matched:
            raise ConfigError(f"source '{source.name}': no files match '{pattern}'")
        files.update(matched)
    return sorted(files)


def job_identity(spec: Spec, catalog: list[SourceCatalog]) -> dict[str, Any]:
    """What decides the data: the spec's data fields and each source's files (size, rows)."""
    files = {}
    for src in catalog:
        rows: dict[str, int] = {}
        for shard in src.shards:
            rows[shard.file] = rows.get(shard.file, 0) + shard.rows
        files[src.name] = [[path, os.path.getsize(path), n] for path, n in sorted(rows.items())]
    data_spec = {k: v for k, v in spec.to_dict().items() if k not in RUNTIME_FIELDS}
    if not spec.has_images:  # a text-only job keeps the identity it had before images existed
        data_spec = {k: v for k, v in data_spec.items() if k not in IMAGE_FIELDS}
        data_spec["cost_coeffs"] = data_spec["cost_coeffs"][:3]
        data_spec["sources"] = [{k: v for k, v in s.items() if k != "image"} for s in data_spec["sources"]]
    return orjson.loads(orjson.dumps({"spec": data_spec, "files": files}))  # as it reads back from a file


def fingerprint(identity: dict[str, Any]) -> str:
    return hashlib.blake2b(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS), digest_size=8).hexdigest()
