"""A tokenizer named by its Hugging Face Hub model id, `ORG/NAME` or `ORG/NAME@REVISION`, as
torchtune and TRL users type it.

The coordinator fetches the model's `tokenizer.json`, and its `tokenizer_config.json` (the chat
template and the bos and eos tokens) where it has one, once and before any worker forks
(fetch_tokenizer), through huggingface_hub's own cache; a worker then finds the files there
without a request (local_tokenizer). huggingface_hub's settings are honoured as it honours
them: HF_TOKEN (a private or gated model), HF_HUB_OFFLINE=1 (the cache only), HF_ENDPOINT,
HF_HUB_CACHE.
"""

from __future__ import annotations

import os
import re

from omniload.errors import ConfigError

_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
_TOKENIZER, _CONFIG = "tokenizer.json", "tokenizer_config.json"


def is_model_id(name: str) -> bool:
    """Whether a tokenizer name is a Hub model id rather than a path or a function: ORG/NAME with
    no `.json` and no `:`, and no such file or folder here (a local path wins)."""
    return bool(_MODEL_ID.fullmatch(name)) and not name.endswith(".json") and not os.path.exists(name)


def _repo_and_revision(name: str) -> tuple[str, str | None]:
    repo, _, revision = name.partition("@")
    return repo, revision or None


def fetch_tokenizer(name: str) -> str:
    """The local path of the model's tokenizer.json, fetched (or checked against the Hub, as
    hf_hub_download does) with its tokenizer_config.json beside it; ConfigError naming the cause."""
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError(
            f"tokenizer {name!r} names a Hugging Face Hub model, which needs huggingface_hub: "
            "pip install 'omniload[hf]'"
        ) from None
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:  # its errors module came in 0.25
        raise ConfigError(
            f"tokenizer {name!r}: huggingface_hub {huggingface_hub.__version__} is too old for omniload: "
            "pip install -U 'huggingface_hub>=0.25'"
        ) from None
    repo, revision = _repo_and_revision(name)
    try:
        path = str(hf_hub_download(repo, _TOKENIZER, revision=revision))
    except HFValidationError as exc:  # (a ValueError: before the OSErrors below, none of which it is)
        raise ConfigError(f"tokenizer {name!r} is not a Hugging Face Hub model id: {exc}") from None
    except LocalEntryNotFoundError:  # (before EntryNotFoundError: it is one)
        raise ConfigError(
            f"tokenizer {name!r} is not in the Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE "
            f"is set, or no network): fetch it once where the Hub can be reached (hf download {repo} {_TOKENIZER} "
            f"{_CONFIG}), or give the path of a tokenizer.json"
        ) from None
    except GatedRepoError:  # (before RepositoryNotFoundError: it is one)
        raise ConfigError(
            f"tokenizer {name!r}: the model is gated on the Hugging Face Hub: accept its terms on its page and set "
            "HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"tokenizer {name!r}: no such model on the Hugging Face Hub (a private one needs HF_TOKEN); a tokenizer "
            "is 'bytes', the path of a tokenizer.json, module:function or a Hub model id ORG/NAME[@REVISION]"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(
            f"tokenizer {name!r}: the model has no revision {revision!r} on the Hugging Face Hub"
        ) from None
    except EntryNotFoundError:
        raise ConfigError(
            f"tokenizer {name!r}: the model has no {_TOKENIZER} (omniload reads a fast tokenizer's tokenizer.json)"
        ) from None
    except OSError as exc:  # the Hub answered with an error of another kind, or the cache cannot be written
        raise ConfigError(f"tokenizer {name!r}: fetching it from the Hugging Face Hub failed: {exc}") from None
    try:
        hf_hub_download(repo, _CONFIG, revision=revision)
    except EntryNotFoundError:  # no config (or offline without it): no chat template, ChatML
        pass
    except OSError as exc:
        raise ConfigError(f"tokenizer {name!r}: fetching its {_CONFIG} failed: {exc}") from None
    return path


def local_tokenizer(name: str) -> str:
    """The model's tokenizer.json in the Hub's cache, where fetch_tokenizer put it, without a
    request; fetched now in a process that found it missing (a script run without a coordinator)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return fetch_tokenizer(name)  # which says what to install
    repo, revision = _repo_and_revision(name)
    found = try_to_load_from_cache(repo, _TOKENIZER, revision=revision)
    return found if isinstance(found, str) else fetch_tokenizer(name)
