"""Store URLs, globs over keys, redaction and store error messages: the pure parts of omniload.storage."""

from __future__ import annotations

import glob
import os

import pytest

from omniload.errors import ConfigError
from omniload.spec import Source, parse_bytes, parse_source
from omniload.storage.stores import explain, is_transient
from omniload.storage.urls import StoreOptions, glob_regex, glob_root, is_remote, parse, redact

KEYS = [
    "a.parquet",
    "b.jsonl",
    "web/a.parquet",
    "web/b.parquet",
    "web/2024/c.parquet",
    "web/2024/d.txt",
    "web2/e.parquet",
    "code/x.jsonl.gz",
    "code/deep/er/y.jsonl",
]


@pytest.mark.parametrize(
    "pattern",
    [
        "*.parquet",
        "web/*.parquet",
        "web/**/*.parquet",
        "**/*.parquet",
        "web/*/*",
        "web?/*.parquet",
        "[ab].*",
        "code/**",
        "web/[!a]*.parquet",
        "**",
    ],
)
def test_globs_match_keys_as_the_local_glob_matches_files(tmp_path, pattern):
    for key in KEYS:
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_text("x")
    local = sorted(
        os.path.relpath(p, tmp_path) for p in glob.glob(str(tmp_path / pattern), recursive=True) if os.path.isfile(p)
    )
    assert sorted(k for k in KEYS if glob_regex(pattern).match(k)) == local


def test_the_listed_prefix_stops_at_the_folder_of_the_first_wildcard():
    assert glob_root("data/web/*.parquet") == "data/web/"
    assert glob_root("data/we*/a.parquet") == "data/"
    assert glob_root("*.parquet") == ""
    assert glob_root("data/a.parquet") == "data/a.parquet"


def test_urls_of_every_store_parse_into_bucket_and_key():
    assert parse("s3://bucket/data/*.parquet").fs_path == "bucket/data/*.parquet"
    assert parse("gs://b/k").store == "gcs"
    url = parse("abfss://container@acct.dfs.core.windows.net/dir/f.parquet")
    assert (url.store, url.bucket, url.account, url.key) == ("azure", "container", "acct", "dir/f.parquet")
    assert url.with_key("dir/g.parquet") == "abfss://container@acct.dfs.core.windows.net/dir/g.parquet"
    hub = parse("hf://datasets/org/name@main/data/*.parquet")
    assert (hub.bucket, hub.key) == ("datasets/org/name@main", "data/*.parquet")
    assert is_remote("s3://b/k") and not is_remote("/data/x.parquet") and not is_remote("data/*.parquet")


@pytest.mark.parametrize(
    "url, message",
    [
        ("ftp://host/file", "unknown store 'ftp://'"),
        ("s3:///key", "no bucket in the URL"),
        ("s3://buck*/key", "the bucket cannot be a glob"),
        ("hf://org/name/file", "hf://datasets/ORG/NAME[@REVISION]/PATH"),
        ("s3://AKIAXYZ:topsecret@bucket/key", "credentials or signed parameters in a URL"),
        ("s3://bucket/key?X-Amz-Signature=abc", "credentials or signed parameters in a URL"),
    ],
)
def test_bad_urls_are_refused_when_the_spec_is_built_naming_the_source(url, message):
    with pytest.raises(ConfigError) as error:
        parse_source(f"web={url}")
    assert message in str(error.value) and "source 'web'" in str(error.value)
    assert "topsecret" not in str(error.value) and "abc" not in str(error.value)


def test_a_lone_question_mark_is_a_glob_not_a_signed_url():
    url = parse("s3://bucket/data/part-?.parquet")
    assert url.key == "data/part-?.parquet" and glob_regex(url.key).match("data/part-7.parquet")


def test_store_options_come_from_the_source_and_the_endpoint_must_be_a_url():
    source = parse_source(
        "web=s3://b/web/*.parquet,weight=0.5,endpoint=http://127.0.0.1:9000,region=eu-west-1,anonymous=true"
    )
    assert source.store_options() == StoreOptions("http://127.0.0.1:9000", "eu-west-1", True)
    with pytest.raises(ConfigError, match="endpoint must be a URL"):
        Source(name="web", path="s3://b/k", endpoint="127.0.0.1:9000")
    with pytest.raises(ConfigError, match="credentials in endpoint=") as error:
        Source(name="web", path="s3://b/k", endpoint="http://key:hunter22@127.0.0.1:9000")
    assert "hunter22" not in str(error.value)


def test_redaction_masks_credentials_signatures_and_secret_variables(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI")
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefgh")
    text = redact("s3://AKIA:pw@bucket/k https://h/o?X-Amz-Signature=feed&x=1 key wJalrXUtnFEMI token hf_abcdefgh")
    assert "pw@" not in text and "feed" not in text and "wJalrXUtnFEMI" not in text and "hf_abcdefgh" not in text
    assert "x=1" in text
    assert redact("abfs://c@acct.dfs.core.windows.net/x") == "abfs://c@acct.dfs.core.windows.net/x"


def test_sizes_take_units():
    assert parse_bytes("64MB") == 64 << 20 and parse_bytes("2GiB") == 2 << 30 and parse_bytes(1024) == 1024
    assert parse_bytes("1.5k") == 1536
    with pytest.raises(ConfigError, match="read-ahead must be a size in bytes"):
        parse_bytes("lots", "read_ahead")


@pytest.mark.parametrize(
    "error, expected, transient",
    [
        ("AWS Error NO_SUCH_BUCKET during ListObjectsV2 operation", "bucket 'b' does not exist at", False),
        ("AWS Error ACCESS_DENIED during HeadObject operation: No response body.", "access denied", False),
        (
            "AWS Error NETWORK_CONNECTION during GetObject: curlCode: 7, Could not connect to server",
            "cannot reach the endpoint",
            True,
        ),
        (
            "AWS Error NETWORK_CONNECTION during GetObject: curlCode: 56, Connection reset by peer",
            "reset by peer",
            True,
        ),
        ("AWS Error SLOW_DOWN during GetObject: Please reduce your request rate.", "SLOW_DOWN", True),
        ("AWS Error INTERNAL_FAILURE during GetObject (HTTP 503)", "503", True),
    ],
)
def test_store_errors_are_explained_and_classified(error, expected, transient):
    exc = OSError(error)
    assert is_transient(exc) is transient
    assert expected in explain(exc, "s3://b/k", parse("s3://b/k"), StoreOptions(endpoint="http://127.0.0.1:1"))


@pytest.mark.parametrize("key", ["train-00403-of-01024", "train-00404-of-01024", "logs-00401-x", "part-00503"])
def test_a_store_error_is_classified_by_what_it_says_never_by_the_objects_name(key):
    """Hugging Face-style shard names hold 401, 403 and 503: a timeout on any of them is a
    timeout, and a missing object named `partial` or `timeout` is not one."""
    timeout = OSError(
        f"When getting information for key 'web/{key}.parquet' in bucket 'corpus': AWS Error NETWORK_CONNECTION "
        "during HeadObject operation: curlCode: 28, Timeout was reached"
    )
    assert is_transient(timeout)
    assert "access denied" not in explain(timeout, "s3://corpus/x", parse("s3://corpus/x"), StoreOptions())
    missing = OSError(f"Path does not exist 'corpus/web/{key}-partial-timeout-503.parquet'. Detail: [errno 2]")
    assert not is_transient(missing)
    denied = OSError(f"When reading 'corpus/{key}': AWS Error ACCESS_DENIED during GetObject operation")
    assert not is_transient(denied) and "access denied" in explain(
        denied, "s3://corpus/x", parse("s3://corpus/x"), StoreOptions(anonymous=True)
    )
    hub = OSError(f"503 Server Error: Service Unavailable for url: https://huggingface.co/api/{key}-403")
    assert is_transient(hub)


def test_missing_credentials_are_named_as_such(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    message = explain(OSError("ACCESS_DENIED"), "s3://b/k", parse("s3://b/k"), StoreOptions())
    assert "no AWS credentials found" in message
    public = explain(OSError("ACCESS_DENIED"), "s3://b/k", parse("s3://b/k"), StoreOptions(anonymous=True))
    assert "anonymous=true" in public


def test_an_azure_url_without_an_account_says_where_to_give_one(monkeypatch):
    from omniload.storage.stores import filesystem

    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
    with pytest.raises(ConfigError, match="AZURE_STORAGE_ACCOUNT_NAME"):
        filesystem(parse("az://container/k"), StoreOptions())
