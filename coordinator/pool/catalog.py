"""Find and index every source's files at startup, so bad input fails before any worker runs.

Local globs are matched here; a source's URLs (s3://, gs://, az://, hf://) are listed and
their objects indexed in the indexing child, which has pyarrow (omniload.storage), many
objects at once. A job that reads a store keeps its catalog (CATALOG_FILE) in its checkpoint
folder and, with --cache-dir, in the cache: a restart, a standby or the next run of the same
sources reads it instead of listing and indexing again; workers still check each object's
size and version when they read it, so a changed object stops the job instead of changing a batch.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import logging
import os
import zipfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from omniload.coordinator.pool.forkserver import forkserver_context
from omniload.errors import ConfigError
from omniload.formats.lane_config import ChatConfig, ImageConfig, Pretokenized
from omniload.formats.records import ids_fit_uint16
from omniload.formats.shard_table import ShardTable, table_arrays, table_from_arrays
from omniload.formats.shards import BadFile, Shard, detect_format
from omniload.order import MAX_ORDINAL
from omniload.spec import STORE_FIELDS, Source, Spec, without_later_defaults
from omniload.spec_options import CHAT_FIELDS, IMAGE_FIELDS, RUNTIME_FIELDS
from omniload.storage.urls import StoreOptions, is_remote, redact
from omniload.workers.chat import chat_config
from omniload.workers.hub_tokenizer import fetch_tokenizer, is_model_id
from omniload.workers.images import load_image_transform, require_pillow
from omniload.workers.transforms import load_transform, vocab_size
from omniload.workers.watchdog import exit_with

log = logging.getLogger("omniload")
CATALOG_FILE = "catalog-{key}.npz"
_CATALOG_LAYOUT = 2  # the kept catalog's: columns (ShardTable) and each source's bad files

# A source's files as indexed: its good shards, and (path, format, why) of each file that cannot be read.
Indexed = tuple[ShardTable, list[tuple[str, str, str]]]
_INDEX_THREADS = 32  # objects of a store indexed at once: each is two round trips (a HEAD, a GET)


@dataclass(frozen=True, slots=True)
class SourceCatalog:
    index: int
    name: str
    column: str
    tokenizer: str
    shards: ShardTable  # columns: 66-72 B a shard (a tuple of Shard: some 350; shard_table.py)
    rows: int
    epochs: int  # passes over this source; 0: forever
    image_column: str | None = None
    images: ImageConfig | None = None  # set when its samples carry images
    store: StoreOptions = StoreOptions()  # how to reach its store, if its files are URLs
    pretokenized: Pretokenized | None = None  # set when its files hold token ids
    chat: ChatConfig | None = None  # set when its rows are conversations
    id_bytes: int = 4  # what a token id takes in its ring records: 2 where they are uint16 (id_bytes_of)


def chat_config_of(source: Source, spec: Spec) -> ChatConfig | None:
    """How a chat source's conversations are rendered (workers/chat.py); None for other sources."""
    if source.kind != "chat":
        return None
    try:
        return chat_config(spec.tokenizer_of(source), spec.seq_len, source.train_on, spec.long_chats == "drop")
    except ConfigError as exc:
        raise ConfigError(f"source '{source.name}': {exc}") from None


def id_bytes_of(source: Source, tokenizer: str, pretokenized: Pretokenized | None, vocab: int | None) -> int:
    """Bytes a token id takes in the source's ring records, as far as is known before its
    workers run (records.ids_fit_uint16): 2 for the byte tokenizer, a tokenizer.json of at most
    65,536 ids, a flat token file of uint8/uint16 ids or token ids checked below such a
    vocabulary; else 4: a function's ids, a larger vocabulary, a Megatron file without vocab=
    (its dtype is in each file), and conversations and samples with images, whose masks and
    pixels the ids do not measure. Where this says 4 and the ids fit, the records are uint16
    all the same and the ring holds more tokens; where it says 2 for a text source whose column
    holds wider ids (a list column read as is, unchecked), half the tokens: read-ahead only."""
    if source.kind == "chat" or source.has_images:
        return 4
    if pretokenized is not None:
        file_dtype = pretokenized.dtype if source.format == "tokens" else None
        return 2 if ids_fit_uint16(file_dtype, pretokenized.vocab) else 4
    return 2 if tokenizer == "bytes" or ids_fit_uint16(vocab=vocab) else 4


def pretokenized_of(source: Source, tokenizer_vocab: int | None) -> Pretokenized | None:
    """How a source of token ids is read and checked; None for a source of text. Its vocabulary
    is vocab=, else its tokenizer's (check_tokenizers; the default `bytes` declares none)."""
    if not source.holds_tokens:
        return None
    vocab = source.vocab if source.vocab is not None else tokenizer_vocab
    return Pretokenized(source.dtype, source.eos, vocab)


def image_config(spec: Spec) -> ImageConfig | None:
    """How the job decodes images; None for a text-only job."""
    if not spec.has_images:
        return None
    height, width = spec.image_hw
    assert spec.image_token is not None  # the spec requires it once a source has images
    return ImageConfig(height, width, spec.image_token, spec.tokens_per_image, spec.image_transform)


def build_catalog(spec: Spec) -> list[SourceCatalog]:
    """Every source's shards. The files are indexed in a child forked from the workers'
    forkserver, which has pyarrow imported already: the coordinator itself never imports it
    (some 30 MB; workers/lane.py). The caller stops the forkserver (pool.stop_helpers)."""
    for tokenizer in sorted({spec.tokenizer_of(source) for source in spec.sources}):
        if is_model_id(tokenizer):  # fetched here, once: the workers read the Hub's cache
            fetch_tokenizer(tokenizer)
    chats = [chat_config_of(source, spec) for source in spec.sources]  # a bad chat template fails first
    for source in spec.sources:
        _check_images(source, spec)
    found = {source.name: _find_files(source) for source in spec.sources if source.manifest is None}
    # a source with a manifest is read from it at every start: the kept catalog holds the others
    remote = any(is_remote(p) for source in spec.sources if source.manifest is None for p in source.path)
    with _indexing_child() as child:
        vocabs = _checked_tokenizers(spec, child)
        cached = _cached_catalog(spec) if remote else None
        if cached is not None:
            path, kept = cached
            log.warning("read the sources' catalog from %s (remove it to list the store again)", path)
            indexed = [read_manifest(s) if s.manifest is not None else kept[i] for i, s in enumerate(spec.sources)]
        else:
            fresh = iter(_index_in(child, spec, found, vocabs))
            indexed = [next(fresh) if source.manifest is None else read_manifest(source) for source in spec.sources]
            if remote:
                _keep_catalog(spec, indexed)
    return [
        _catalog_of(i, source, spec, files, vocabs[source.name], chats[i])
        for i, (source, files) in enumerate(zip(spec.sources, indexed))
    ]


def write_manifests(spec: Spec, folder: Path) -> list[tuple[Path, int, int, list[tuple[str, str, str]]]]:
    """`omniload index`: list and index every source's objects now and write each source's
    manifest, SOURCE.manifest.npz in `folder`; (path, objects, rows, bad files) of each."""
    for source in spec.sources:
        _check_images(source, spec)
    found = {source.name: _find_files(source) for source in spec.sources}
    with _indexing_child() as child:
        # every file, bad ones recorded (they count no rows): the job reading the manifest decides
        # by its own --on-bad-file whether a bad file stops it
        indexed = _index_in(child, spec, found, _checked_tokenizers(spec, child), stop_at_bad=False)
    written = []
    for source, (table, bad) in zip(spec.sources, indexed):
        path = folder / f"{source.name}.manifest.npz"
        meta = {"layout": _CATALOG_LAYOUT, "manifest_of": _definition(source), "bad": bad}
        try:
            _write_arrays(path, {"meta": _json_array(meta), **table_arrays(table, "0/")})
        except OSError as exc:
            raise ConfigError(f"--out {str(folder)!r}: cannot write {path.name}: {exc}") from None
        written.append((path, table.file_count, int(table.column("rows").sum()), bad))
    return written


def read_manifest(source: Source) -> Indexed:
    """A source's objects as `omniload index` wrote them; ConfigError naming what to fix. The
    workers check each object's size and version when they first read it, so an object changed
    since stops the job naming it."""
    assert source.manifest is not None
    where = f"source '{source.name}': manifest {source.manifest!r}"
    again = "write it again with `omniload index` and this source"
    try:
        with np.load(os.path.expanduser(source.manifest), allow_pickle=False) as arrays:
            meta = orjson.loads(arrays["meta"].tobytes())
            if meta.get("layout") != _CATALOG_LAYOUT or "manifest_of" not in meta:
                raise ConfigError(f"{where} is not a manifest this omniload reads: {again}")
            if meta["manifest_of"] != _definition(source):
                raise ConfigError(
                    f"{where} was written for {meta['manifest_of']}, not for this source's "
                    f"{_definition(source)}: {again}"
                )
            return table_from_arrays(arrays, "0/"), [tuple(b) for b in meta["bad"]]
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist: write it with `omniload index` and this source") from None
    except (OSError, orjson.JSONDecodeError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{where} cannot be read ({exc}): {again}") from None


def _definition(source: Source) -> dict[str, Any]:
    """What decides a source's objects and shards (its name, weight, tokenizer, store and
    manifest do not)."""
    fields = without_later_defaults(dataclasses.asdict(source))
    fields["path"] = list(source.path)
    return {k: v for k, v in fields.items() if k not in ("name", "weight", "epochs", "tokenizer", *STORE_FIELDS)}


def _indexing_child() -> ProcessPoolExecutor:
    """The child that loads tokenizers and lists and indexes the sources, forked from the
    workers' forkserver. It ends with this process: a coordinator killed while it indexed a
    large bucket (a SIGKILL, the Job's startup timeout) left it listing and reading the store,
    and the forkserver waiting on it, for as long as the index took."""
    child = ProcessPoolExecutor(1, mp_context=forkserver_context())
    try:
        child.submit(exit_with, os.getpid()).result()
    except BaseException:
        child.shutdown(cancel_futures=True)
        raise
    return child


def _checked_tokenizers(spec: Spec, child: ProcessPoolExecutor) -> dict[str, int | None]:
    return child.submit(check_tokenizers, {s.name: spec.tokenizer_of(s) for s in spec.sources}).result()


def _index_in(
    child: ProcessPoolExecutor,
    spec: Spec,
    found: dict[str, list[tuple[str, str]]],
    vocabs: dict[str, int | None],
    stop_at_bad: bool | None = None,
) -> list[Indexed]:
    """The sources named in `found` (with their local files) listed and indexed in the
    indexing child, in the spec's order."""
    sources = [source for source in spec.sources if source.name in found]
    if not sources:
        return []
    requests = [
        IndexRequest(
            source.name,
            tuple(found[source.name]),
            tuple(p for p in source.path if is_remote(p)),
            source.format,
            source.read_column,
            source.image,
            source.store_options(),
            pretokenized_of(source, vocabs[source.name]),
            "tokens" if source.tokens is not None else source.kind,
        )
        for source in sources
    ]
    stop = spec.on_bad_file == "stop" if stop_at_bad is None else stop_at_bad
    return list(child.submit(index_files, requests, stop, spec.cache_dir, spec.cache_limit).result())


@dataclass(frozen=True, slots=True)
class IndexRequest:
    """One source's files for the indexing child: local files found, URLs still to list."""

    name: str
    files: tuple[tuple[str, str], ...]  # (path, format)
    urls: tuple[str, ...]  # globs in a store
    format: str
    column: str
    image: str | None
    store: StoreOptions
    pretokenized: Pretokenized | None = None
    values: str = "text"  # what the column holds: text (or token ids), tokens (tokens=), chat (kind=chat)


def check_tokenizers(tokenizers: dict[str, str]) -> dict[str, int | None]:
    """Runs in the indexing child: each source's tokenizer loaded once, so a bad one fails
    before any worker runs and its vocabulary (a 32k BPE: 7.5 MB, and 12 MB of heap its parse
    leaves free) never sits in the coordinator; returns each source's vocabulary size
    (transforms.vocab_size)."""
    vocabs = {}
    for name, tokenizer in tokenizers.items():
        try:
            load_transform(tokenizer)
        except ConfigError as exc:
            raise ConfigError(f"source '{name}': {exc}") from None
        vocabs[name] = vocab_size(tokenizer)
    return vocabs


def index_files(
    sources: list[IndexRequest], stop_at_bad: bool, cache_dir: str | None = None, cache_limit: int = 0
) -> list[Indexed]:
    """Runs in the indexing child: per source, its files' shards in columns (sent to the
    coordinator as a few arrays, not an object a shard), their ordinals following on from the
    file before, and the files that cannot be read and why (they count no rows); a source's
    files end at its first bad one when the job stops on one. With the job's block cache
    (--cache-dir, --cache-limit), the blocks read to index an object are kept
    there, so a worker reading it next takes them from the cache instead of the store: a
    small object the index read whole costs a cold start one HEAD and one GET, not two of each."""
    from concurrent.futures import ThreadPoolExecutor

    from omniload.storage.disk_cache import DiskCache
    from omniload.storage.files import Files

    disk = DiskCache(cache_dir, cache_limit) if cache_dir else None
    out = []
    for request in sources:
        files = sorted(set(request.files) | set(_listed(request)))
        access = Files(request.store, cache=disk, fetchers=_INDEX_THREADS)  # a GET in flight for each object indexed
        remote = [path for path, _ in files if is_remote(path)]
        index = functools.partial(_index_one, request, access)
        ahead: dict[str, list[Shard] | str] = {}
        if remote:  # objects are a few round trips each: index them at once, number their rows after
            with ThreadPoolExecutor(_INDEX_THREADS) as pool:
                ahead = dict(zip(remote, pool.map(index, [(p, f) for p, f in files if is_remote(p)])))
        rows, good, bad = 0, list[Shard](), list[tuple[str, str, str]]()
        for path, fmt in files:
            shards = ahead[path] if path in ahead else index((path, fmt), rows)
            if isinstance(shards, str):
                bad.append((path, fmt, shards))
                if stop_at_bad:
                    break
                continue
            if path in ahead:
                shards = [dataclasses.replace(s, first_ordinal=s.first_ordinal + rows) for s in shards]
            good.extend(shards)
            rows += sum(s.rows for s in shards)
        access.close()
        out.append((ShardTable(good), bad))
    return out


def _index_one(request: IndexRequest, access: Any, item: tuple[str, str], rows: int = 0) -> list[Shard] | str:
    """One file's shards (ordinals from `rows`), or why it cannot be read; ConfigError when the
    store failed past its retries (never a file to skip). In the indexing child."""
    from omniload.workers.readers import index_file

    path, fmt = item
    try:
        return index_file(path, fmt, request.column, rows, request.image, access, request.pretokenized, request.values)
    except BadFile as exc:
        return redact(str(exc))
    except OSError as exc:
        raise ConfigError(f"source '{request.name}': {exc}") from None


def _listed(request: IndexRequest) -> list[tuple[str, str]]:
    """(url, format) of the objects the source's URLs name."""
    from omniload.storage.objects import list_matching

    found = []
    for pattern in request.urls:
        try:
            urls = list_matching(pattern, request.store)
        except (ConfigError, OSError) as exc:  # OSError: the store failed past its retries
            raise ConfigError(f"source '{request.name}': {exc}") from None
        for url in _without_indexes(urls):
            fmt = request.format if request.format != "auto" else detect_format(url)
            if fmt is None:
                raise ConfigError(
                    f"source '{request.name}': cannot tell the format of {redact(url)!r} from its "
                    "name; add format=parquet|jsonl|arrow|tar|megatron|tokens to the source"
                )
            found.append((url, fmt))
    return found


def _without_indexes(paths: list[str]) -> list[str]:
    """The paths less each Megatron .idx whose .bin is among them (a glob such as `data/web_*`
    names both; the .bin is the dataset, its .idx is read beside it)."""
    present = set(paths)
    return [p for p in paths if not (p.endswith(".idx") and p[: -len(".idx")] + ".bin" in present)]


def _catalog_key(spec: Spec) -> str:
    sources = [
        {k: v for k, v in without_later_defaults(s).items() if k not in ("weight", "epochs", "tokenizer")}
        for s in spec.to_dict()["sources"]
    ]
    return hashlib.blake2b(
        orjson.dumps([sources, spec.on_bad_file], option=orjson.OPT_SORT_KEYS), digest_size=8
    ).hexdigest()


def _catalog_paths(spec: Spec, kept_only: bool = False) -> list[Path]:
    """Where the catalog is looked for (the folder resumed from first), or only where it is kept."""
    name = CATALOG_FILE.format(key=_catalog_key(spec))
    folders = [
        None if kept_only else spec.resume,
        spec.checkpoint_dir,
        os.path.join(spec.cache_dir, "catalogs") if spec.cache_dir else None,
    ]
    return [Path(folder) / name for folder in folders if folder]


def _cached_catalog(spec: Spec) -> tuple[Path, list[Indexed]] | None:
    for path in _catalog_paths(spec):
        try:
            with np.load(path, allow_pickle=False) as arrays:
                meta = orjson.loads(arrays["meta"].tobytes())
                if meta["layout"] != _CATALOG_LAYOUT:
                    raise ValueError(f"layout {meta['layout']}, this omniload reads {_CATALOG_LAYOUT}")
                return path, [
                    (table_from_arrays(arrays, f"{i}/"), [tuple(b) for b in bad]) for i, bad in enumerate(meta["bad"])
                ]
        except FileNotFoundError:
            continue
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError, zipfile.BadZipFile) as exc:
            # damaged, or another version's
            log.warning("ignoring the catalog at %s (%s): listing the store again", path, exc)
    return None


def _keep_catalog(spec: Spec, indexed: list[Indexed]) -> None:
    """The catalog as columns (np.savez, no pickle) with its sources' bad files."""
    arrays = {"meta": _json_array({"layout": _CATALOG_LAYOUT, "bad": [bad for _, bad in indexed]})}
    for i, (table, _) in enumerate(indexed):
        arrays |= table_arrays(table, f"{i}/")
    for path in _catalog_paths(spec, kept_only=True):
        try:
            _write_arrays(path, arrays)
        except OSError as exc:
            log.warning("could not keep the catalog at %s: %s", path, exc)


def _json_array(value: Any) -> np.ndarray:
    return np.frombuffer(orjson.dumps(value), np.uint8)


def _write_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez to a temporary file beside `path`, then renamed: a reader never sees half a file.
    (Number arrays only: nothing is pickled, and np.load reads it with allow_pickle=False.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    with open(temporary, "wb") as file:
        np.savez(file, **arrays)  # type: ignore[arg-type]  # (numpy's stubs fear a key named allow_pickle)
    os.replace(temporary, path)


def _check_images(source: Source, spec: Spec) -> None:
    """A source of images: its image transform loaded once here, so a bad one fails before any
    worker runs (its tokenizer: check_tokenizers; its chat template: build_catalog)."""
    if source.has_images:
        require_pillow(source.name)
        config = image_config(spec)
        assert config is not None  # the source has images
        load_image_transform(config)  # a bad --image-transform fails here, not in every worker


def _find_files(source: Source) -> list[tuple[str, str]]:
    """The source's local files and their formats (its URLs are listed in the indexing child)."""
    files = []
    for path in _without_indexes(_match_files(source) if any(not is_remote(p) for p in source.path) else []):
        fmt = source.format if source.format != "auto" else detect_format(path)
        if fmt is None:
            raise ConfigError(
                f"source '{source.name}': cannot tell the format of {path!r} from its name; "
                "add format=parquet|jsonl|arrow|tar|megatron|tokens to the source"
            )
        files.append((path, fmt))
    return files


def _catalog_of(
    index: int,
    source: Source,
    spec: Spec,
    indexed: Indexed,
    vocab: int | None,
    chat: ChatConfig | None,
) -> SourceCatalog:
    images = image_config(spec) if source.has_images else None
    shards, bad = indexed
    for path, _, why in bad:
        if spec.on_bad_file == "stop":
            raise ConfigError(
                f"source '{source.name}': {path}: {why} (the job stops on a bad file; "
                "--on-bad-file skip skips it instead)"
            )
        log.warning("source '%s': skipping %s: %s", source.name, path, why)
    if images is None and "tar" in shards.formats:  # the glob did not say .tar, the files do
        tar = next(s.file for s in shards if s.format == "tar")
        raise ConfigError(
            f"source '{source.name}': {tar} is a tar file: give format=tar to the source "
            "(and --image-token) so that its images are decoded"
        )
    rows = int(shards.column("rows").sum())
    if rows == 0:
        raise ConfigError(f"source '{source.name}': its files hold no rows")
    if rows >= MAX_ORDINAL:
        raise ConfigError(f"source '{source.name}': {rows} rows exceed the limit of {MAX_ORDINAL}; split the source")
    epochs = spec.epochs if source.epochs is None else source.epochs
    tokenizer, pretokenized = spec.tokenizer_of(source), pretokenized_of(source, vocab)
    return SourceCatalog(
        index,
        source.name,
        source.read_column,
        tokenizer,
        shards,
        rows,
        epochs,
        source.image,
        images,
        source.store_options(),
        pretokenized,
        chat,
        id_bytes_of(source, tokenizer, pretokenized, vocab),
    )


def _match_files(source: Source) -> list[str]:
    files: set[str] = set()
    for pattern in source.path:
        if is_remote(pattern):
            continue
        matched = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)]
        if not matched:
            raise ConfigError(f"source '{source.name}': no files match '{pattern}'")
        files.update(matched)
    return sorted(files)


def job_identity(spec: Spec, catalog: list[SourceCatalog]) -> dict[str, Any]:
    """What decides the data: the spec's data fields and each source's files (size, rows)."""
    files = {
        src.name: [
            [path, size, rows, version] if is_remote(path) else [path, os.path.getsize(path), rows]
            for path, size, version, rows in sorted(src.shards.files())
        ]
        for src in catalog
    }
    data_spec = {k: v for k, v in spec.to_dict().items() if k not in RUNTIME_FIELDS}
    if not spec.has_images:  # a text-only job keeps the identity it had before images existed
        data_spec = {k: v for k, v in data_spec.items() if k not in IMAGE_FIELDS}
        data_spec["cost_coeffs"] = data_spec["cost_coeffs"][:3]
        data_spec["sources"] = [{k: v for k, v in s.items() if k != "image"} for s in data_spec["sources"]]
    if not spec.has_chat:  # a job without conversations keeps the identity it had before them
        data_spec = {k: v for k, v in data_spec.items() if k not in CHAT_FIELDS}
    data_spec["sources"] = [without_later_defaults(s) for s in data_spec["sources"]]
    if spec.cost_model is None:  # its coefficients are cost_coeffs: a job without one keeps its identity
        data_spec.pop("cost_model")
    if spec.rank_tokens == "fixed":  # the cap and padding of variable budgets decide nothing here
        for name in ("rank_tokens", "max_rank_tokens", "pad_to"):
            data_spec.pop(name)
    # where a store is and how to reach it decides no batch (the objects' versions do)
    data_spec["sources"] = [{k: v for k, v in s.items() if k not in STORE_FIELDS} for s in data_spec["sources"]]
    return orjson.loads(orjson.dumps({"spec": data_spec, "files": files}))  # as it reads back from a file


def fingerprint(identity: dict[str, Any]) -> str:
    return hashlib.blake2b(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS), digest_size=8).hexdigest()
