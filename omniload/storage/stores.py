"""One filesystem per store, made from the store's standard settings, and what its errors mean.

The I/O layer is `pyarrow.fs`: S3, GCS and Azure are native C++ clients there (ranged reads
that release the GIL), pyarrow is already what reads the files, and its files plug straight
into the parquet and Arrow readers. The Hugging Face Hub has no pyarrow client: its fsspec
filesystem (`huggingface_hub`, the `omniload[hf]` extra) is wrapped into one.

Credentials come only from each store's own places (AWS variables, profiles and roles;
GOOGLE_APPLICATION_CREDENTIALS; AZURE_STORAGE_*; HF_TOKEN), never from the spec, so nothing
secret reaches a log, a status or a checkpoint. Runs in workers and the indexing child only:
the coordinator never imports pyarrow.
"""

from __future__ import annotations

import os
import re
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from omniload.errors import ConfigError
from omniload.storage.urls import ObjectUrl, StoreOptions, redact

CONNECT_S, REQUEST_S = 5.0, 30.0  # a dead endpoint fails a request fast; our retries (objects.py) bound the rest
_SDK_ATTEMPTS = 1  # no retries inside the AWS SDK: ours (objects.retrying) are counted, bounded and jittered


_made: dict[tuple[str, str | None, StoreOptions], pafs.FileSystem] = {}
_lock = threading.Lock()


def filesystem(url: ObjectUrl, options: StoreOptions) -> pafs.FileSystem:
    """The process's filesystem for a URL's store (made once per store, account and options)."""
    key = (url.store, url.account, options)
    with _lock:
        if key not in _made:
            _made[key] = _make(url, options)
        return _made[key]


def endpoint_of(url: ObjectUrl, options: StoreOptions) -> str:
    """The endpoint requests for `url` go to, for error messages."""
    if options.endpoint:
        return options.endpoint
    if url.store == "s3":
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
    if url.store == "gcs":
        return os.environ.get("STORAGE_EMULATOR_HOST") or "Google Cloud Storage"
    if url.store == "azure":
        return f"{_azure_account(url)}.blob.core.windows.net"
    return os.environ.get("HF_ENDPOINT") or "the Hugging Face Hub"


def _split_endpoint(endpoint: str) -> tuple[str, str]:
    scheme, sep, host = endpoint.partition("://")
    return (scheme, host.rstrip("/")) if sep else ("https", endpoint.rstrip("/"))


def _make(url: ObjectUrl, options: StoreOptions) -> pafs.FileSystem:
    if url.store == "s3":
        # S3FileSystem() alone ignores AWS_ENDPOINT_URL (FileSystem.from_uri reads it): read it here
        endpoint = options.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        kwargs: dict = dict(
            anonymous=options.anonymous,
            connect_timeout=CONNECT_S,
            request_timeout=REQUEST_S,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=_SDK_ATTEMPTS),
        )
        region = options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kwargs["region"] = region
        if endpoint:  # path-style addressing: works with an IP endpoint (loopback, in-cluster stores)
            scheme, host = _split_endpoint(endpoint)
            kwargs.update(endpoint_override=host, scheme=scheme, force_virtual_addressing=False)
        return pafs.S3FileSystem(**kwargs)
    if url.store == "gcs":
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        # an emulator takes no credentials (as Google's own clients treat STORAGE_EMULATOR_HOST)
        anonymous = options.anonymous or bool(
            emulator and not options.endpoint and not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        )
        kwargs = dict(anonymous=anonymous, retry_time_limit=timedelta(seconds=REQUEST_S))
        endpoint = options.endpoint or emulator
        if endpoint:
            scheme, host = _split_endpoint(endpoint if "://" in endpoint else f"http://{endpoint}")
            kwargs.update(endpoint_override=host, scheme=scheme)
        return pafs.GcsFileSystem(**kwargs)
    if url.store == "azure":
        kwargs = dict(account_name=_azure_account(url))
        key = os.environ.get("AZURE_STORAGE_KEY") or os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
        if key:
            kwargs["account_key"] = key
        elif sas := os.environ.get("AZURE_STORAGE_SAS_TOKEN"):
            kwargs["sas_token"] = sas
        if options.endpoint:
            scheme, host = _split_endpoint(options.endpoint)
            kwargs.update(
                blob_storage_authority=host,
                blob_storage_scheme=scheme,
                dfs_storage_authority=host,
                dfs_storage_scheme=scheme,
            )
        return pafs.AzureFileSystem(**kwargs)
    try:
        from huggingface_hub import HfFileSystem
    except ImportError:
        raise ConfigError(_NO_HUB_CLIENT) from None
    hub = HfFileSystem(token=_hub_token(options), endpoint=options.endpoint)
    return pafs.PyFileSystem(_HubHandler(hub))


class _HubHandler(pafs.FSSpecHandler):
    """HfFileSystem opens a file by listing its folder once (then cached): a folder's files open
    one at a time, or every thread opening one at once would list the folder again."""

    def __init__(self, fs: Any) -> None:
        super().__init__(fs)
        self._folders: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def open_input_file(self, path: str) -> Any:
        with self._lock:
            folder = self._folders.setdefault(path.rpartition("/")[0], threading.Lock())
        with folder:
            return super().open_input_file(path)


_NO_HUB_CLIENT = "reading hf:// URLs needs the Hub client: pip install 'omniload[hf]'"


def _hub_token(options: StoreOptions) -> str | bool | None:
    """False: anonymous; None: huggingface_hub's own (with HF_TOKEN unset, the cached login)."""
    return False if options.anonymous else os.environ.get("HF_TOKEN") or None


def hub_commit(url: ObjectUrl, options: StoreOptions) -> str:
    """The commit a Hub URL's revision (a branch, a tag; the default branch when it names none)
    points at now. The job reads that commit throughout (its URLs name it), so a repository that
    moves on while the job runs, or before it resumes, changes no batch."""
    from urllib.parse import unquote

    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:
        raise ConfigError(_NO_HUB_CLIENT) from None

    kind, _, repo = url.bucket.partition("/")
    kind = kind.removesuffix("s")  # datasets -> dataset, the API's repo_type
    repo_id, _, revision = repo.partition("@")
    api = HfApi(endpoint=options.endpoint, token=_hub_token(options))
    where = redact(url.with_key(url.key))
    try:
        info = api.repo_info(repo_id, repo_type=kind, revision=unquote(revision) or None)
    except RevisionNotFoundError:
        raise ConfigError(f"{where}: {kind} repository '{repo_id}' has no revision '{unquote(revision)}'") from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{where}: no {kind} repository '{repo_id}' at {endpoint_of(url, options)}; check its name, or set "
            "HF_TOKEN to a token that may read it (private or gated)"
        ) from None
    if not info.sha:
        raise FileNotFoundError(f"the Hub gave no commit for {url.bucket}")
    return str(info.sha)


def _azure_account(url: ObjectUrl) -> str:
    account = url.account or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") or os.environ.get("AZURE_STORAGE_ACCOUNT")
    if not account:
        raise ConfigError(
            f"{url.scheme}://{url.bucket}/...: no Azure storage account: set AZURE_STORAGE_ACCOUNT_NAME "
            "or write abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH"
        )
    return account


# What a store's error says, as words our clients write: transient ones are worth retrying.
# They are looked for in the message with the object's key, the bucket and any URL taken out
# (_evidence): a key is the user's name, and `train-00403-of-01024.parquet` says nothing about
# access. Numbers match as whole words only (an HTTP status, never a part of a longer token).
_TRANSIENT = (
    "curlcode",
    "network_connection",
    "connection reset",
    "connection refused",
    "timed out",
    "timeout",
    "slow_down",
    "slowdown",
    "throttl",
    "503",
    "500",
    "502",
    "504",
    "internal_failure",
    "internalerror",
    "service unavailable",
    "partial",
    "reset by peer",
    "broken pipe",
    "request_timeout",
    "unavailable",
    "too many requests",
    "429",
    "incomplete",
    "temporarily",
)
_DENIED = (
    "access_denied",
    "accessdenied",
    "403",
    "forbidden",
    "permission",
    "unauthorized",
    "401",
    "invalidaccesskeyid",
    "signaturedoesnotmatch",
    "authorizationfailure",
    "not authorized",
)
_NO_BUCKET = ("no_such_bucket", "nosuchbucket", "bucket does not exist", "containernotfound", "the specified container")
_UNREACHABLE = (
    "curlcode: 7",
    "could not connect",
    "couldn't connect",
    "connection refused",
    "could not resolve",
    "name or service not known",
    "curlcode: 6",
    "curlcode: 28",
    "failed to connect",
)


_NAMES = re.compile(r"'[^']*'|\"[^\"]*\"|\b\w+://\S+")  # quoted keys and buckets, URLs


def _pattern(words: tuple[str, ...]) -> re.Pattern[str]:
    """Any of `words` in a message; a word that is a number, only where no letter, digit, dash,
    dot or slash is next to it."""
    parts = [rf"(?<![\w./-]){re.escape(w)}(?![\w./-])" if w.isdigit() else re.escape(w.strip()) for w in words]
    return re.compile("|".join(parts))


_IS_TRANSIENT, _IS_DENIED, _IS_NO_BUCKET, _IS_UNREACHABLE = map(
    _pattern, (_TRANSIENT, _DENIED, _NO_BUCKET, _UNREACHABLE)
)


def _evidence(exc: BaseException) -> str:
    """What the error says, lowercased, without the names in it (see _TRANSIENT)."""
    return _NAMES.sub(" ", str(exc)).lower()


def is_transient(exc: BaseException) -> bool:
    text = _evidence(exc)
    return not (_IS_DENIED.search(text) or _IS_NO_BUCKET.search(text)) and bool(_IS_TRANSIENT.search(text))


def is_unreachable(exc: BaseException) -> bool:
    return bool(_IS_UNREACHABLE.search(_evidence(exc)))


def explain(exc: BaseException, where: str, url: ObjectUrl, options: StoreOptions) -> str:
    """A store error as a message naming the URL and the likely fix (secrets redacted)."""
    text = str(exc)
    lower = _evidence(exc)
    endpoint = endpoint_of(url, options)
    if _IS_NO_BUCKET.search(lower):
        message = f"{where}: bucket '{url.bucket}' does not exist at {endpoint}; check its name (and the endpoint)"
    elif _IS_DENIED.search(lower):
        message = f"{where}: access denied at {endpoint}: {_credentials_hint(url, options)}"
    elif is_unreachable(exc):
        message = (
            f"{where}: cannot reach the endpoint {endpoint}; check endpoint= (or the store's endpoint "
            "variable) and that the store is up"
        )
    elif isinstance(exc, FileNotFoundError) or "not found" in lower or "does not exist" in lower:
        message = f"{where}: no such object"
    else:
        message = f"{where}: {text}"
    return redact(message)


def _credentials_hint(url: ObjectUrl, options: StoreOptions) -> str:
    if options.anonymous:
        return (
            "the request was anonymous (anonymous=true): the bucket is not public; drop anonymous= and give credentials"
        )
    if url.store == "s3":
        if not aws_credentials_configured():
            return (
                "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run "
                "with a role; a public bucket reads with anonymous=true"
            )
        return "the credentials found may not read this bucket (check AWS_PROFILE / the keys' policy)"
    if url.store == "gcs":
        return (
            "check GOOGLE_APPLICATION_CREDENTIALS (a service account that may read the bucket), or "
            "anonymous=true for a public bucket"
        )
    if url.store == "azure":
        return "check AZURE_STORAGE_KEY / AZURE_STORAGE_SAS_TOKEN (or the Azure identity variables)"
    return "set HF_TOKEN to a token that may read this repository (gated or private)"


def aws_credentials_configured() -> bool:
    """Whether any AWS credential source is set up here: keys, a profile, a web identity, a
    container role, or the shared files (an instance role cannot be seen from here)."""
    env = os.environ
    if (
        env.get("AWS_ACCESS_KEY_ID")
        or env.get("AWS_PROFILE")
        or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
        or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    ):
        return True
    files = [env.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"), env.get("AWS_CONFIG_FILE", "~/.aws/config")]
    return any(Path(os.path.expanduser(f)).is_file() for f in files)
