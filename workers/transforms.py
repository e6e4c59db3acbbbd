"""Transforms turn a shard's values into token arrays (int32, or uint16 where every id fits), one per value.

`bytes`: UTF-8 bytes as tokens (vocabulary 256). A path to a Hugging Face `tokenizer.json`:
the `tokenizers` library (extra `omniload[tokenizers]`), no download. A Hugging Face Hub model
id, `ORG/NAME[@REVISION]`: its tokenizer.json, from the Hub's cache (hub_tokenizer.py).
`module:function`: the user's function, called on each value and returning a sequence of ints. Values that are
already token arrays (a list<int> column) pass through whatever the transform.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from omniload.errors import ConfigError
from omniload.formats.records import ids_fit_uint16
from omniload.workers.hub_tokenizer import is_model_id, local_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

Transform = Callable[[Sequence[object]], list[np.ndarray]]


@functools.cache
def load_transform(name: str) -> Transform:
    """Resolve a tokenizer name; raises ConfigError saying what to fix. Once per process: a
    worker's lanes share one tokenizer (a 32k BPE holds some 7.5 MB once parsed)."""
    if name == "bytes":
        return _bytes_transform
    path = tokenizer_file(name)
    if path is not None:
        return _hf_transform(path)
    module, sep, func = name.partition(":")
    if not sep or not module or not func:
        raise ConfigError(
            f"tokenizer {name!r}: expected 'bytes', a tokenizer.json path, module:function or a Hugging Face Hub "
            "model id ORG/NAME[@REVISION]"
        )
    try:
        fn = getattr(importlib.import_module(module), func)
    except ImportError as exc:
        raise ConfigError(f"tokenizer {name!r}: cannot import module '{module}': {exc}") from None
    except AttributeError:
        raise ConfigError(f"tokenizer {name!r}: module '{module}' has no function '{func}'") from None
    except Exception as exc:  # the user's module runs on import; whatever it raises is the cause
        raise ConfigError(
            f"tokenizer {name!r}: importing module '{module}' failed: {type(exc).__name__}: {exc}"
        ) from None
    return _per_value(fn)


def vocab_size(name: str) -> int | None:
    """The vocabulary of a tokenizer.json (added tokens included); None for the others: `bytes`
    is the default, not a declaration, and a function's vocabulary is not known. Raises
    ConfigError as load_transform does."""
    path = tokenizer_file(name)
    if path is None:
        return None
    return int(_tokenizer_file(path).get_vocab_size(with_added_tokens=True))


def names_tokenizer_file(name: str) -> bool:
    """Whether a tokenizer name stands for a tokenizer.json: a path to one, or a Hub model id."""
    return name.endswith(".json") or is_model_id(name)


def tokenizer_file(name: str) -> str | None:
    """The tokenizer.json a tokenizer name stands for: the path itself, or a Hub model's file in
    the Hub's cache (hub_tokenizer.local_tokenizer); None for `bytes` and a function."""
    if not names_tokenizer_file(name):
        return None
    return name if name.endswith(".json") else local_tokenizer(name)


@functools.cache  # parsed once a process, for its transform and its vocabulary alike
def _tokenizer_file(path: str) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a tokenizer.json; raises ConfigError saying what to fix."""
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer file {path!r} does not exist")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            f"tokenizer {path!r} needs the tokenizers library: pip install 'omniload[tokenizers]'"
        ) from None
    try:
        return Tokenizer.from_file(path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # plain Exception for malformed files; a Rust panic is a BaseException
        raise ConfigError(f"tokenizer file {path!r} cannot be loaded: {exc}") from None


def _bytes_transform(values: Sequence[object]) -> list[np.ndarray]:
    return [
        v if isinstance(v, np.ndarray) else np.frombuffer(_text(v).encode("utf-8"), np.uint8).astype(np.uint16)
        for v in values
    ]


def _hf_transform(path: str) -> Transform:
    tokenizer = _tokenizer_file(path)
    # every id of a vocabulary of at most 65,536 fits uint16: the record then needs no check
    dtype = np.uint16 if ids_fit_uint16(vocab=vocab_size(path)) else np.int32

    def transform(values: Sequence[object]) -> list[np.ndarray]:
        texts = [_text(v) for v in values if not isinstance(v, np.ndarray)]
        # no offsets (nothing here reads them): the same ids as encode_batch for 15-20% less CPU a token
        encoded = iter(tokenizer.encode_batch_fast(texts, add_special_tokens=False))
        return [v if isinstance(v, np.ndarray) else np.asarray(next(encoded).ids, dtype=dtype) for v in values]

    return transform


def _per_value(fn: Callable[[object], Sequence[int]]) -> Transform:
    def transform(values: Sequence[object]) -> list[np.ndarray]:
        return [v if isinstance(v, np.ndarray) else np.asarray(fn(v), dtype=np.int32).reshape(-1) for v in values]

    return transform


def _text(value: object) -> str:
    return "" if value is None else value if isinstance(value, str) else str(value)
