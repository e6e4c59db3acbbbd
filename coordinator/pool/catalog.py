"""Find and index every source's files at startup, so bad input fails before any worker runs."""
from __future__ import annotations

import glob
import hashlib
import logging
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

from omniload.errors import ConfigError
from omniload.order import MAX_ORDINAL
from omniload.spec import IMAGE_FIELDS, RUNTIME_FIELDS, Source, Spec
from omniload.formats.lane_config import ImageConfig
from omniload.workers.images import load_image_transform, require_pillow
from omniload.coordinator.pool.forkserver import forkserver_context
from omniload.formats.shards import BadFile, Shard, detect_format
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
    """Every source's shards. The files are indexed in a child forked from the workers'
    forkserver, which has pyarrow imported already: the coordinator itself never imports it
    (some 30 MB; workers/lane.py). The caller stops the forkserver (pool.stop_helpers)."""
    found = [_find_files(source, spec) for source in spec.sources]
    with ProcessPoolExecutor(1, mp_context=forkserver_context()) as child:
        indexed = child.submit(index_files, [[(path, fmt, source.column, source.image) for path, fmt in files]
                                             for source, files in zip(spec.sources, found)],
                               spec.on_bad_file == "stop").result()
    return [_catalog_of(i, source, spec, files) for i, (source, files) in enumerate(zip(spec.sources, indexed))]


def index_files(sources: list[list[tuple[str, str, str, str | None]]],
                stop_at_bad: bool) -> list[list[tuple[str, str, list[Shard] | str]]]:
    """Runs in the indexing child: per source, each file's (path, format, shards or why it
    cannot be read), its ordinals following on from the file before (a bad file counts no
    rows); a source's files end at its first bad one when the job stops on one."""
    from omniload.workers.readers import index_file

    out = []
    for files in sources:
        rows, done = 0, []
        for path, fmt, column, image in files:
            try:
                shards: list[Shard] | str = index_file(path, fmt, column, rows, image)
            except BadFile as exc:
                done.append((path, fmt, str(exc)))
                if stop_at_bad:
                    break
                continue
            done.append((path, fmt, shards))
            rows += sum(s.rows for s in shards)
        out.append(done)
    return out


def _find_files(source: Source, spec: Spec) -> list[tuple[str, str]]:
    """The source's files and their formats; its tokenizer (and image transform) loaded once
    here, so a bad one fails before any worker runs."""
    tokenizer = source.tokenizer or spec.tokenizer
    try:
        load_transform(tokenizer)
    except ConfigError as exc:
        raise ConfigError(f"source '{source.name}': {exc}") from None
    if source.has_images:
        require_pillow(source.name)
        load_image_transform(image_config(spec))  # a bad --image-transform fails here, not in every worker
    files = []
    for path in _match_files(source):
        fmt = source.format if source.format != "auto" else detect_format(path)
        if fmt is None:
            raise ConfigError(f"source '{source.name}': cannot tell the format of {path!r} from its name; "
                              "add format=parquet|jsonl|arrow|tar to the source")
        files.append((path, fmt))
    return files


def _catalog_of(index: int, source: Source, spec: Spec,
                files: list[tuple[str, str, list[Shard] | str]]) -> SourceCatalog:
    images = image_config(spec) if source.has_images else None
    shards: list[Shard] = []
    for path, fmt, file_shards in files:
        if isinstance(file_shards, str):  # why the file cannot be read
            if spec.on_bad_file == "stop":
                raise ConfigError(f"source '{source.name}': {path}: {file_shards} (the job stops on a bad file; "
                                  "--on-bad-file skip skips it instead)")
            log.warning("source '%s': skipping %s: %s", source.name, path, file_shards)
            continue
        if fmt == "tar" and images is None:  # the glob did not say .tar, the files do
            raise ConfigError(f"source '{source.name}': {path} is a tar file: give format=tar to the source "
                              "(and --image-token) so that its images are decoded")
        shards.extend(file_shards)
    rows = sum(s.rows for s in shards)
    if rows == 0:
        raise ConfigError(f"source '{source.name}': its files hold no rows")
    if rows >= MAX_ORDINAL:
        raise ConfigError(f"source '{source.name}': {rows} rows exceed the limit of {MAX_ORDINAL}; split the source")
    epochs = spec.epochs if source.epochs is None else source.epochs
    return SourceCatalog(index, source.name, source.column, source.tokenizer or spec.tokenizer, tuple(shards), rows,
                         epochs, source.image, images)


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
