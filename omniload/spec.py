"""The job spec: what to read, how to mix and pack it, and the parallel layout.

Flags, a YAML/JSON file and Python all build the same frozen `Spec` through `Spec.from_dict`,
which validates every field and names it in the error. Each field but `sources` has one row in
omniload.spec_options (its group, help, value and checks), from which the CLI, `--help` and
docs/cli.md derive. A file (or dict) may nest the options in their groups; the Spec stays flat
(`spec.seq_len`), as flags and `Spec(seq_len=...)` name them. `Spec.to_dict()` is what the
launcher hands to the coordinator process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omniload.errors import ConfigError
from omniload.formats.shards import TOKEN_FILES
from omniload.model_shape import parse_model_shape
from omniload.spec_options import BYTE_FIELDS, GROUP_OF, GROUPS, OPTIONS
from omniload.storage.urls import StoreOptions, is_remote, parse

FORMATS = ("auto", "parquet", "jsonl", "arrow", "tar", "megatron", "tokens")
KINDS = ("text", "chat")
CHAT_COLUMNS = "messages|conversations"
TRAIN_ON = ("assistant", "all")
TOKEN_DTYPES = ("uint8", "uint16", "int16", "int32", "uint32", "int64")  # format=tokens: the ids' type
RAMPS = ("constant", "linear")
AXES = ("tp", "cp", "dp", "pp")
# cost = a*len^2 + b*len + c + d*images; see omniload.coordinator.cost for where these come from
DEFAULT_COST_COEFFS = (1.0, 24576.0, 0.0, 256 * 24576.0)
_FROZEN = dict(frozen=True, slots=True, kw_only=True)
# The automatic shuffle horizon (plan/spread.py): 2**28 tokens, and at least 64 global batches'
# worth. A long document of L tokens then reaches each step as L / horizon of its source's
# tokens: a 1M-token book is 0.4% of a step, where the 8M-token window before it made the book
# an eighth of every step for a few steps (docs/planning.md). The fill, read before the first
# draw, 2**27 tokens and at least 16 global batches: a corpus of up to that many tokens is a
# global shuffle of each epoch, and a larger one starts from a shuffle of that many.
_AUTO_HORIZON_TOKENS, _AUTO_HORIZON_BATCHES = 1 << 28, 64
_AUTO_FILL_TOKENS, _AUTO_FILL_BATCHES = 1 << 27, 16


@dataclass(**_FROZEN)
class Source:
    """One data source: files matching `path` (a glob, or several), mixed in by `weight`."""

    name: str
    path: tuple[str, ...]
    weight: float = 1.0
    column: str = "text"
    format: str = "auto"
    tokenizer: str | None = None  # None: the job's tokenizer
    epochs: int | None = None  # None: the job's epochs
    image: str | None = None  # parquet/Arrow: the column of encoded images (a .tar source's images are its members)
    # a store's URLs (s3://, gs://, az://, hf://): what differs from the store's environment defaults
    endpoint: str | None = None  # http[s]://host:port of an S3-compatible store, a GCS or Azure endpoint, a Hub mirror
    region: str | None = None
    anonymous: bool = False  # unsigned requests (a public bucket)
    # sources of token ids, read without a tokenizer (docs/sources.md)
    tokens: str | None = None  # parquet/Arrow/JSON lines: the column of token-id lists
    dtype: str = "uint16"  # format=tokens: the type of the ids in the file
    eos: int | None = None  # format=tokens: the id that ends each document
    vocab: int | None = None  # every token id must be below it (default: a tokenizer.json's vocabulary)
    # conversations (docs/sources.md): rows of `messages` [{role, content}] or `conversations` [{from, value}]
    kind: str = "text"  # text | chat
    train_on: str = "assistant"  # chat: the tokens the loss counts: the assistant's replies, or all
    manifest: str | None = None  # `omniload index`'s file of its objects: nothing is listed or indexed

    def __post_init__(self) -> None:
        if isinstance(self.path, str):
            object.__setattr__(self, "path", (self.path,))
        else:
            object.__setattr__(self, "path", tuple(self.path))
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"source name {self.name!r}: use letters, digits, '-' and '_'")
        if not self.path or not all(self.path):
            raise ConfigError(f"source '{self.name}': give a path (a glob of files)")
        if not math.isfinite(self.weight) or self.weight < 0:
            raise ConfigError(f"source '{self.name}': weight must be >= 0, got {self.weight}")
        if self.format not in FORMATS:
            raise ConfigError(f"source '{self.name}': format must be one of {FORMATS}, got {self.format!r}")
        if self.epochs is not None and self.epochs < 0:
            raise ConfigError(f"source '{self.name}': epochs must be >= 0, got {self.epochs}")
        if self.image is not None and not self.image:
            raise ConfigError(f"source '{self.name}': image= needs a column name")
        self._check_token_fields()
        self._check_chat_fields()
        for path in self.path:
            if is_remote(path):
                try:
                    parse(path)
                except ConfigError as exc:
                    raise ConfigError(f"source '{self.name}': {exc}") from None
        if self.manifest is not None and not all(is_remote(p) for p in self.path):
            raise ConfigError(
                f"source '{self.name}': manifest= is for a store's URLs (s3://, gs://, az://, hf://), whose "
                "listing is slow; a local glob is listed in milliseconds and its files are checked as they are"
            )
        if self.endpoint is not None and "@" in self.endpoint.partition("://")[2].partition("/")[0]:
            raise ConfigError(
                f"source '{self.name}': credentials in endpoint= would be written to logs and checkpoints; "
                "give them in the store's environment variables (see docs/storage.md)"
            )
        if self.endpoint is not None and "://" not in self.endpoint:
            raise ConfigError(
                f"source '{self.name}': endpoint must be a URL like http://127.0.0.1:9000, got {self.endpoint!r}"
            )

    def _check_token_fields(self) -> None:
        where = f"source '{self.name}'"
        if self.tokens is not None and (not self.tokens or self.format in TOKEN_FILES or self.image is not None):
            raise ConfigError(
                f"{where}: tokens= names a column of token-id lists in parquet, Arrow or JSON lines files "
                f"(without image=); got tokens={self.tokens!r} with format={self.format}"
            )
        if self.dtype not in TOKEN_DTYPES:
            raise ConfigError(f"{where}: dtype must be one of {TOKEN_DTYPES}, got {self.dtype!r}")
        if self.format == "tokens" and self.eos is None:
            raise ConfigError(
                f"{where}: format=tokens needs eos=ID, the token id that ends each document "
                "(GPT-2's <|endoftext|>, as in nanoGPT's train.bin, is 50256)"
            )
        if (self.eos is not None or self.dtype != "uint16") and self.format != "tokens":
            raise ConfigError(f"{where}: eos= and dtype= describe a flat token file: give format=tokens too")
        if self.vocab is not None and not self.holds_tokens:
            raise ConfigError(
                f"{where}: vocab= checks the ids of a source of token ids (tokens=COLUMN, format=megatron "
                "or format=tokens); a text source's ids come from its tokenizer"
            )
        if self.eos is not None and self.eos < 0:
            raise ConfigError(f"{where}: eos must be a token id >= 0, got {self.eos}")
        if self.vocab is not None and self.vocab < 1:
            raise ConfigError(f"{where}: vocab must be the vocabulary size (>= 1), got {self.vocab}")
        if self.vocab is not None and self.eos is not None and self.eos >= self.vocab:
            raise ConfigError(f"{where}: eos={self.eos} is not below vocab={self.vocab}")

    def _check_chat_fields(self) -> None:
        where = f"source '{self.name}'"
        if self.kind not in KINDS:
            raise ConfigError(f"{where}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.train_on not in TRAIN_ON:
            raise ConfigError(f"{where}: train_on must be one of {TRAIN_ON}, got {self.train_on!r}")
        if self.kind != "chat":
            if self.train_on != "assistant":
                raise ConfigError(f"{where}: train_on= says which turns of a conversation train: give kind=chat too")
            return
        if self.image is not None or self.holds_tokens or self.format not in ("auto", "jsonl", "parquet", "arrow"):
            raise ConfigError(
                f"{where}: kind=chat reads conversations from JSON lines, parquet or Arrow files "
                f"(without image= or tokens=); got format={self.format}"
            )

    @property
    def holds_tokens(self) -> bool:
        """Whether the source's files hold token ids (read without a tokenizer): a tokens= column,
        a Megatron indexed dataset or a flat token file."""
        if self.tokens is not None or self.format in TOKEN_FILES:
            return True
        return self.format == "auto" and all(p.lower().endswith(".bin") for p in self.path)

    @property
    def read_column(self) -> str:
        """The column its values are read from: tokens= if given, else column=; a conversation's,
        unless column= names one, is `messages` or else `conversations` ("a|b": the first found)."""
        if self.tokens is not None:
            return self.tokens
        return CHAT_COLUMNS if self.kind == "chat" and self.column == "text" else self.column

    def store_options(self) -> StoreOptions:
        return StoreOptions(self.endpoint, self.region, self.anonymous)

    @property
    def has_images(self) -> bool:
        """Whether the source's samples carry images: an image column, or WebDataset-style tar files."""
        return self.image is not None or self.format == "tar" or all(_is_tar(p) for p in self.path)


@dataclass(**_FROZEN)
class Phase:
    """One phase of the mixture schedule: `weights` until a step or a token count."""

    weights: dict[str, float]
    until_step: int | None = None
    until_tokens: int | None = None
    ramp: str = "constant"

    def __post_init__(self) -> None:
        if (self.until_step is None) == (self.until_tokens is None):
            raise ConfigError(f"mixture phase {self.weights}: give exactly one of until_step or until_tokens")
        if self.ramp not in RAMPS:
            raise ConfigError(f"mixture phase: ramp must be one of {RAMPS}, got {self.ramp!r}")
        check_weights(self.weights, "mixture phase")

    @property
    def until(self) -> int:
        if self.until_step is not None:
            return self.until_step
        assert self.until_tokens is not None  # __post_init__: exactly one of the two is set
        return self.until_tokens


@dataclass(**_FROZEN)
class Spec:
    """Everything that decides which batches a job yields (plus a few runtime knobs)."""

    sources: tuple[Source, ...]
    tokenizer: str = "bytes"
    epochs: int = 1
    on_bad_file: str = "stop"
    image_size: str = "224x224"
    image_transform: str | None = None
    image_token: int | None = None
    tokens_per_image: int = 1
    shard_interleave: int = 4
    seq_len: int = 2048
    rows: int = 1
    steps: int = 0
    long_docs: str = "split"
    long_chats: str = "truncate"
    max_doc_share: float = 0.25
    rank_tokens: str = "fixed"
    max_rank_tokens: int = 0
    pad_to: int = 128
    seed: int = 0
    plan_ahead: int = 8
    mixture: tuple[Phase, ...] = ()
    balance: str = "attention"
    cost_coeffs: tuple[float, ...] = DEFAULT_COST_COEFFS
    cost_model: str | None = None
    balance_window: int = 0
    shuffle_window: int = 0
    shuffle_fill: int = 0
    shuffle_dir: str | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_split: str = "sequence"
    rank_order: str = "tp-cp-dp-pp"
    pp_data: str = "first-last"
    broadcast_at: str = "none"
    workers: int = 0
    reserve_cpus: int = 1
    autoscale_every: float = 5.0
    ring_mb: int = 4
    max_restarts: int = 3
    worker_timeout: float = 300.0
    checkpoint_dir: str | None = None
    snapshot_every: int = 100
    keep_snapshots: int = 2
    resume: str | None = None
    allow_changed_data: bool = False
    rank_timeout: float = 600.0
    metrics_port: int | None = None
    senders: int = -1
    read_ahead: int = 64 << 20
    cache_dir: str | None = None
    cache_limit: int = 16 << 30

    def __post_init__(self) -> None:  # noqa: C901, PLR0912  (one check a field: to split by group)
        object.__setattr__(self, "sources", tuple(self.sources))
        if not self.sources:
            raise ConfigError("no sources: give at least one --source NAME=GLOB")
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"source names must be unique, repeated: {', '.join(dupes)}")
        if sum(s.weight for s in self.sources) <= 0:
            raise ConfigError("source weights are all zero: give at least one source a weight > 0")
        for name, spec_option in OPTIONS.items():
            value = getattr(self, name)
            if spec_option.at_least is not None:
                _at_least(name, value, spec_option.at_least)
            if spec_option.choices and value not in spec_option.choices:
                raise ConfigError(f"{name.replace('_', '-')} must be one of {spec_option.choices}, got {value!r}")
        if not self.autoscale_every >= 0:
            raise ConfigError(
                f"autoscale-every must be >= 0 seconds (0: split by weight once), got {self.autoscale_every}"
            )
        if self.worker_timeout <= 0:
            raise ConfigError(f"worker_timeout must be > 0 seconds, got {self.worker_timeout}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics-port must be a port number (0: any free port), got {self.metrics_port}")
        if self.senders < -1:
            raise ConfigError(
                f"senders must be >= 0 (0: the coordinator writes to the ranks itself; -1: one per 64 "
                f"ranks, at most one per 8 cores), got {self.senders}"
            )
        if not self.rank_timeout >= 0:
            raise ConfigError(f"rank-timeout must be >= 0 seconds (0: wait forever), got {self.rank_timeout}")
        if not 0 < self.max_doc_share <= 1:
            raise ConfigError(f"max-doc-share must be in (0, 1], got {self.max_doc_share}")
        if self.cache_dir == "auto":
            from omniload.storage.disk_cache import default_dir  # no pyarrow there

            object.__setattr__(self, "cache_dir", default_dir())
        if sorted(self.rank_order.split("-")) != sorted(AXES):
            raise ConfigError(
                f"rank-order must name each of tp, cp, dp, pp once, fastest first "
                f"(e.g. tp-cp-dp-pp), got {self.rank_order!r}"
            )
        if len(self.cost_coeffs) == 3:  # a,b,c as before images: an image costs the default d
            object.__setattr__(self, "cost_coeffs", (*self.cost_coeffs, DEFAULT_COST_COEFFS[3]))
        if len(self.cost_coeffs) != 4:
            raise ConfigError(
                f"cost-coeffs must be numbers a,b,c[,d] (cost a*len^2 + b*len + c + d*images), got {self.cost_coeffs!r}"
            )
        self._check_cost_model()
        self._check_images()
        self._check_rank_tokens()
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            raise ConfigError(
                f"seq-len {self.seq_len} must be divisible by 2*cp = {2 * self.cp} "
                "for the load-balanced context-parallel split"
            )
        self._check_mixture(names)

    def _check_cost_model(self) -> None:
        if self.cost_model is None:
            return
        coeffs = parse_model_shape(self.cost_model).cost_coeffs()
        if self.cost_coeffs not in (DEFAULT_COST_COEFFS, coeffs):
            raise ConfigError(
                f"cost-model {self.cost_model!r} and cost-coeffs {self.cost_coeffs!r} both set the cost: give one"
            )
        if self.balance != "attention":
            raise ConfigError(f"cost-model sets the attention cost: it needs --balance attention, got {self.balance!r}")
        object.__setattr__(self, "cost_coeffs", coeffs)

    def _check_rank_tokens(self) -> None:
        if self.max_rank_tokens and self.max_rank_tokens < self.rows * self.seq_len:
            raise ConfigError(
                f"max-rank-tokens {self.max_rank_tokens} must be at least rows x seq-len = "
                f"{self.rows * self.seq_len}, the mean a rank takes (0: twice that)"
            )
        if self.rank_tokens == "variable" and self.cp > 1 and self.cp_split == "row":
            raise ConfigError(
                "rank-tokens variable with cp > 1 needs the per-sequence context-parallel split: a "
                "rank's one packed sequence has no rows to cut; use --cp-split sequence"
            )

    @property
    def rank_token_cap(self) -> int:
        """rank_tokens=variable: the most tokens (real and padding) a rank's sequence holds."""
        return self.max_rank_tokens or 2 * self.rows * self.seq_len

    def _check_images(self) -> None:
        self.image_hw  # noqa: B018  (raises ConfigError on a bad --image-size)
        with_images = [s.name for s in self.sources if s.has_images]
        if with_images and self.image_token is None:
            raise ConfigError(
                f"source '{with_images[0]}' has images: give --image-token ID, the placeholder "
                "token id your model's vocabulary reserves for an image"
            )
        if self.image_token is not None and not 0 <= self.image_token < 2**31:
            raise ConfigError(f"image-token must be a token id >= 0, got {self.image_token}")

    @property
    def has_images(self) -> bool:
        return any(s.has_images for s in self.sources)

    @property
    def has_chat(self) -> bool:
        return any(s.kind == "chat" for s in self.sources)

    @property
    def masks_labels(self) -> bool:
        """Whether batches carry a label mask: a conversation trains on its replies only."""
        return any(s.kind == "chat" and s.train_on == "assistant" for s in self.sources)

    @property
    def image_hw(self) -> tuple[int, int]:
        """--image-size as (height, width)."""
        h, sep, w = str(self.image_size).lower().partition("x")
        try:
            hw = (int(h), int(w)) if sep else (int(h), int(h))
        except ValueError:
            hw = (0, 0)
        if min(hw) < 1 or max(hw) > 8192:
            raise ConfigError(f"image-size must be HxW in pixels (e.g. 224x224), got {self.image_size!r}")
        return hw

    def _check_mixture(self, names: list[str]) -> None:
        object.__setattr__(self, "mixture", tuple(self.mixture))
        if not self.mixture:
            return
        if len({p.until_step is None for p in self.mixture}) > 1:
            raise ConfigError("mixture: use until_step in every phase or until_tokens in every phase, not both")
        untils = [p.until for p in self.mixture]
        if untils != sorted(set(untils)):
            raise ConfigError(f"mixture: phase ends must increase, got {untils}")
        for phase in self.mixture:
            unknown = sorted(set(phase.weights) - set(names))
            if unknown:
                raise ConfigError(
                    f"mixture phase names unknown source(s) {', '.join(unknown)}; sources: {', '.join(names)}"
                )

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def shuffle_horizon(self, dp: int, share: float) -> tuple[int, int]:
        """(horizon, fill) in tokens of the shuffle of a source drawing `share` of the tokens at
        data-parallel size dp (plan/spread.py): its share of the job's, so every source's
        horizon spans the same number of steps and the disk it holds does not grow with the
        number of sources. The fill is at most the horizon."""
        batch = dp * self.rows * self.seq_len
        horizon = self.shuffle_window * self.seq_len or max(_AUTO_HORIZON_TOKENS, _AUTO_HORIZON_BATCHES * batch)
        fill = min(horizon, self.shuffle_fill * self.seq_len or max(_AUTO_FILL_TOKENS, _AUTO_FILL_BATCHES * batch))
        return max(1, math.ceil(horizon * share)), math.ceil(fill * share)

    def tokenizer_of(self, source: Source) -> str:
        """The tokenizer `source` uses: its own, else the job's."""
        return source.tokenizer or self.tokenizer

    def weights(self) -> list[float]:
        total = sum(s.weight for s in self.sources)
        return [s.weight / total for s in self.sources]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sources"] = [dict(s, path=list(s["path"])) for s in d["sources"]]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "spec") -> Spec:
        data = ungroup(data, where)
        _reject_unknown(data, {f.name for f in dataclasses.fields(cls)}, where)
        raw_sources = data.pop("sources", [])
        if not isinstance(raw_sources, (list, tuple)):
            raise ConfigError(f"{where}: 'sources' must be a list of sources")
        sources = [parse_source(s, where) for s in raw_sources]
        if "mixture" in data:
            data["mixture"] = tuple(parse_phase(p, where) for p in data["mixture"] or ())
        return cls(sources=tuple(sources), **{k: _coerce(cls, k, v, where) for k, v in data.items()})


_UNDESCRIBED = {f.name for f in dataclasses.fields(Spec)} ^ {"sources", *OPTIONS}
if _UNDESCRIBED:  # a field added without its row, or a row left behind: say which at import
    raise RuntimeError(f"Spec fields and omniload.spec_options.OPTIONS differ: {sorted(_UNDESCRIBED)}")


def ungroup(data: dict[str, Any], where: str = "spec") -> dict[str, Any]:
    """Flat options from ones nested in GROUPS (`batching: {seq_len: 4096}`); flat ones pass.
    `workers` is both a group and a field: a mapping there is the group."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in GROUPS and isinstance(value, dict):
            options = {str(k).replace("-", "_"): v for k, v in value.items()}
            misplaced = [f"'{k}' belongs in group '{GROUP_OF[k]}'" for k in options if GROUP_OF.get(k, key) != key]
            if misplaced:
                raise ConfigError(f"{where}: group '{key}': {'; '.join(misplaced)}")
            _reject_unknown(options, set(GROUPS[key]), f"{where}: group '{key}'")
        elif key in GROUPS and key not in GROUPS[key]:
            raise ConfigError(f"{where}: group '{key}' must be a mapping of its options ({', '.join(GROUPS[key])})")
        else:
            options = {key: value}
        for name, option in options.items():
            if name in flat:
                raise ConfigError(f"{where}: '{name}' is given twice (flat and in its group); give it once")
            flat[name] = option
    return flat


# A source's fields that say how to reach its store or find its objects, never what they hold.
STORE_FIELDS = ("endpoint", "region", "anonymous", "manifest")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}


def parse_bytes(value: str | int, name: str = "size") -> int:
    """A byte count: an integer, or a number with a unit (K, M, G, T; KB = KiB = 1024)."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("bgikmt")
    try:
        return int(float(number) * _UNITS[text[len(number) :]])
    except (KeyError, ValueError):
        raise ConfigError(
            f"{name.replace('_', '-')} must be a size in bytes like 67108864, 64MB or 2GiB, got {value!r}"
        ) from None


# A source's fields added after checkpoints existed, with their defaults: a source that leaves them
# at the default keeps the job identity (and the checkpoints) it had before.
LATER_SOURCE_FIELDS = {
    "tokens": None,
    "dtype": "uint16",
    "eos": None,
    "vocab": None,
    "kind": "text",
    "train_on": "assistant",
    "manifest": None,
}


def without_later_defaults(source: dict[str, Any]) -> dict[str, Any]:
    """A source's dict less the LATER_SOURCE_FIELDS it leaves at their defaults."""
    return {k: v for k, v in source.items() if k not in LATER_SOURCE_FIELDS or v != LATER_SOURCE_FIELDS[k]}


def check_weights(weights: object, where: str, names: Sequence[str] | None = None) -> dict[str, float]:
    """Mixture weights as given in a phase or a live change (`omniload mix`): a mapping of source
    names (of `names`, when given) to numbers >= 0, not all zero. The one place they are checked."""
    if not isinstance(weights, dict) or not weights:
        raise ConfigError(f"{where}: give weights as NAME=WEIGHT for one or more sources, got {weights!r}")
    if names is not None and (unknown := sorted(set(weights) - set(names))):
        raise ConfigError(f"{where}: unknown source(s) {', '.join(unknown)}; sources: {', '.join(names)}")
    if any(
        not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0
        for w in weights.values()
    ):
        raise ConfigError(f"{where}: weights must map source names to numbers >= 0, got {weights!r}")
    if sum(weights.values()) <= 0:
        raise ConfigError(f"{where} {weights}: weights are all zero")
    return {str(k): float(v) for k, v in weights.items()}


def parse_phase(value: dict[str, Any] | Phase, where: str = "spec") -> Phase:
    if isinstance(value, Phase):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: a mixture phase must be a mapping, got {value!r}")
    _reject_unknown(value, {f.name for f in dataclasses.fields(Phase)}, f"{where}: mixture phase")
    return Phase(**value)


def parse_source(value: str | dict[str, Any] | Source, where: str = "spec") -> Source:
    """Build a Source from `NAME=GLOB[,weight=W][,column=C][,format=F][,tokenizer=T]` or a dict."""
    if isinstance(value, Source):
        return value
    if isinstance(value, str):
        head, *options = value.split(",")
        name, sep, path = head.partition("=")
        if not sep:
            raise ConfigError(f"{where}: source {value!r}: expected NAME=GLOB[,weight=W][,column=C]")
        fields: dict[str, Any] = {"name": name.strip(), "path": path.strip()}
        for option in options:
            key, sep, val = option.partition("=")
            if not sep:
                raise ConfigError(f"{where}: source '{name}': option {option!r} is not KEY=VALUE")
            fields[key.strip()] = val.strip()
        value = fields
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: a source must be a string or a mapping, got {value!r}")
    value = dict(value)
    if "path" not in value and "paths" in value:
        value["path"] = value.pop("paths")
    label = f"{where}: source '{value.get('name', '?')}'"
    _reject_unknown(value, {f.name for f in dataclasses.fields(Source)}, label)
    return Source(**{k: _coerce(Source, k, v, label) for k, v in value.items()})


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON job file into a flat dict of Spec fields (names as the flags, - or _;
    nested in GROUPS or not)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: {exc.strerror}") from None
    import yaml  # JSON is YAML; imported here so ranks never pay for it

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML/JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping of options at the top")
    data = ungroup({str(k).replace("-", "_"): v for k, v in data.items()}, f"config file {str(path)!r}")
    if "source" in data:  # the flag's name, as a list of NAME=GLOB strings
        data.setdefault("sources", []).extend(data.pop("source"))
    return data


def _is_tar(path: str) -> bool:
    return path.lower().endswith((".tar", ".tar.gz", ".tgz"))


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise ConfigError(f"{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")


def _reject_unknown(data: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _boolean(name: str, value: Any, where: str) -> bool:
    """A yes or no from a flag, a file or the environment; anything else names the option."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ConfigError(
        f"{where}: {name.replace('_', '-')} must be true or false (or {'/'.join(_TRUE[::2] + _FALSE[::2])}), "
        f"got {value!r}"
    )


def coerce_option(name: str, value: Any, where: str) -> Any:
    """A job option's value from a flag or a variable, in its field's type (Spec.from_dict's way)."""
    return _coerce(Spec, name, value, where)


def _coerce(cls: type, name: str, value: Any, where: str) -> Any:
    """Turn strings from flags and files into the field's type, naming the field on failure."""
    kind = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    if name == "workers" and value == "auto":
        return 0
    if name in BYTE_FIELDS and value is not None:
        return parse_bytes(value, name)
    try:
        if kind in ("int", "int | None") and value is not None and not isinstance(value, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)  # 2.5 is no count of anything: never rounded
            return int(value)
        if kind == "float" and not isinstance(value, float):
            return float(value)
        if kind == "bool":
            return _boolean(name, value, where)
        if kind == "tuple[float, ...]":
            parts = value.split(",") if isinstance(value, str) else value
            return tuple(float(p) for p in parts)
    except (TypeError, ValueError):
        what = "a number or auto" if name == "workers" else "a number"
        raise ConfigError(f"{where}: {name.replace('_', '-')} must be {what}, got {value!r}") from None
    return value
