"""Source paths that name objects in a store, and what may be shown of them; pure.

A source path is a local path or glob, or a URL: `s3://bucket/key`, `gs://bucket/key`,
`az://container/key` (or `abfs[s]://container@account.dfs.core.windows.net/key`) and
`hf://datasets/org/name[@revision]/key`. Globs match keys as they match local paths: `*`, `?`
and `[...]` stay within one `/`-separated part, `**` spans any number of parts (none too).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from omniload.errors import ConfigError

# scheme as written -> the store it names
SCHEMES = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "hf": "hf",
}
_WILDCARDS = "*?["
# Environment variables that hold a secret: their values are never shown.
SECRET_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_SECRET",
    "AZURE_STORAGE_CONNECTION_STRING",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
)
# user:password@ in a URL; not Azure's container@ACCOUNT.dfs.core.windows.net, which is no secret
_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/@\s]+@(?![a-z0-9-]+\.(?:dfs|blob)\.core\.windows\.net)", re.I)
_SIGNED = re.compile(
    r"([?&](?:X-Amz-[A-Za-z-]*|X-Goog-[A-Za-z-]*|sig|signature|se|sv|token|access_token|key)=)"
    r"[^&\s'\"]*",
    re.I,
)


def store_of(path: str) -> str | None:
    """The store a path names (s3, gcs, azure, hf), or None for a local path."""
    scheme, sep, _ = path.partition("://")
    if not sep:
        return None
    return SCHEMES.get(scheme.lower(), "unknown" if scheme.isalnum() and len(scheme) > 1 else None)


def is_remote(path: str) -> bool:
    return store_of(path) is not None


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """What may differ between one job's sources in the same kind of store (a source's
    endpoint=, region=, anonymous=); credentials never: they come from the environment."""

    endpoint: str | None = None  # http[s]://host:port of an S3-compatible, GCS or Azure endpoint; a Hub mirror
    region: str | None = None
    anonymous: bool = False  # unsigned requests, for public buckets


@dataclass(frozen=True, slots=True)
class ObjectUrl:
    """A URL cut into its parts: `bucket` is the S3/GCS bucket, the Azure container or the Hub
    repository (`datasets/org/name[@rev]`); `key` the object's path in it (may hold a glob)."""

    store: str
    scheme: str
    bucket: str
    key: str
    account: str | None = None  # Azure: from `container@ACCOUNT.dfs.core.windows.net`

    @property
    def fs_path(self) -> str:
        """The path a filesystem of this store reads: bucket/key."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    def with_key(self, key: str) -> str:
        """The URL of another key in the same bucket, written as this one was."""
        authority = f"{self.bucket}@{self.account}.dfs.core.windows.net" if self.account else self.bucket
        return f"{self.scheme}://{authority}/{key}"


def parse(url: str) -> ObjectUrl:
    """Cut a store URL into its parts; ConfigError naming what is wrong."""
    store = store_of(url)
    scheme, _, rest = url.partition("://")
    if store in (None, "unknown"):
        raise ConfigError(f"{redact(url)}: unknown store '{scheme}://'; use s3://, gs://, az://, abfs:// or hf://")
    authority, _, key = rest.partition("/")
    # a query with parameters (`?X-Amz-Signature=...`); a lone `?` is a glob's one character
    if "@" in authority and store != "azure" or re.search(r"\?[^/]*=", rest):
        raise ConfigError(
            f"{redact(url)}: credentials or signed parameters in a URL would be written to logs and "
            "checkpoints; give them in the store's environment variables (see docs/storage.md)"
        )
    account = None
    if store == "azure" and "@" in authority:
        authority, _, host = authority.partition("@")
        account = host.split(".", 1)[0] or None
    if store == "hf":
        parts = rest.split("/")
        if len(parts) < 3 or parts[0] not in ("datasets", "models", "spaces"):
            raise ConfigError(f"{url}: a Hub URL is hf://datasets/ORG/NAME[@REVISION]/PATH")
        authority, key = "/".join(parts[:3]), "/".join(parts[3:])
    if not authority:
        raise ConfigError(f"{redact(url)}: no bucket in the URL; expected {scheme}://BUCKET/KEY")
    if any(c in authority for c in _WILDCARDS):
        raise ConfigError(f"{redact(url)}: the bucket cannot be a glob; only the key can")
    return ObjectUrl(store, scheme.lower(), authority, key, account)


def glob_root(key: str) -> str:
    """The part of a key pattern before its first wildcard, cut back to a whole folder ('' for
    a pattern that starts with one): the prefix to list."""
    cut = min((key.index(c) for c in _WILDCARDS if c in key), default=None)
    if cut is None:
        return key
    return key[: key.rfind("/", 0, cut) + 1]


def has_glob(key: str) -> bool:
    return any(c in key for c in _WILDCARDS)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """The regex a key pattern matches with: `*` `?` `[...]` within a part, `**` across parts."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def redact(text: str) -> str:
    """`text` with whatever could be a secret replaced by '***': credentials in a URL, a
    signed URL's parameters, and the value of any secret environment variable."""
    text = _SIGNED.sub(r"\1***", _USERINFO.sub(r"\1***@", text))
    for name in SECRET_VARIABLES:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text
