"""Sources in a Hugging Face Hub dataset (hf://datasets/ORG/NAME/...), read through a fake Hub
endpoint on loopback (tests/fake_hub.py: the tree listing, repo_info and ranged GETs HfFileSystem
uses), never the network: the batches of the same files on local disk, one tree listing a folder
rather than a request a file, and the commit the job listed read throughout however the
repository moves on."""

from __future__ import annotations

import collections
import re

import pytest

from tests.corpus import documents, write_parquet
from tests.fake_hub import FakeHub, serve_hub
from tests.jobs import lockstep_digests

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
pytest.importorskip("huggingface_hub")

SPEC = {"seq_len": 64, "rows": 2, "workers": 2, "seed": 5, "epochs": 1}
FOLDERS, FILES = 2, 4  # data/part{f}/{i}.parquet


def _dataset(tmp_path, seed: int) -> dict[str, bytes]:
    """FOLDERS x FILES parquet files of documents, written under tmp_path/seed{seed}/data as well."""
    files = {}
    for folder in range(FOLDERS):
        for i in range(FILES):
            name = f"data/part{folder}/{i}.parquet"
            path = write_parquet(tmp_path / f"seed{seed}" / name, documents(40, seed * 100 + folder * 10 + i, 2, 60))
            files[name] = path.read_bytes()
    return files


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with serve_hub(FakeHub({})) as served:
        yield served


def _requests(hub: FakeHub) -> collections.Counter[str]:
    """What was asked, by route: revision (repo_info), tree, paths-info, resolve (a file's bytes)."""
    kinds: collections.Counter[str] = collections.Counter()
    for _, path, _ in hub.requests:
        parts = path.split("?")[0].strip("/").split("/")
        kinds["resolve" if parts[0] == "datasets" else parts[4] if len(parts) > 4 else "revision"] += 1
    return kinds


def test_a_hub_dataset_gives_the_batches_its_local_copy_gives_listing_a_folder_once(hub, tmp_path):
    hub.push("org/corpus", _dataset(tmp_path, 1))
    local = {**SPEC, "sources": [{"name": "web", "path": str(tmp_path / "seed1" / "data" / "*" / "*.parquet")}]}
    remote = {
        **SPEC,
        "sources": [{"name": "web", "path": "hf://datasets/org/corpus/data/*/*.parquet", "endpoint": hub.url}],
    }
    assert lockstep_digests(remote, 2) == lockstep_digests(local, 2)
    asked = _requests(hub)
    # never a request a file: huggingface_hub 2.x asks no paths-info, 0.25 one a process
    assert asked["paths-info"] <= 3 and asked["resolve"] <= 4 * FOLDERS * FILES, asked
    # the coordinator, its indexing child and each of the 2 workers list each folder at most once
    assert asked["tree"] <= 4 * (FOLDERS + 1), asked


def test_the_job_reads_the_commit_it_listed_however_the_repository_moves_on(hub, tmp_path):
    """The listing pins the revision (main) to its commit: the URLs a job holds name it, so a
    push between listing and reading (or before a resume that keeps its catalog) changes nothing
    it reads; a new listing sees the new commit."""
    from omniload.storage.files import Files
    from omniload.storage.objects import list_matching
    from omniload.storage.urls import StoreOptions
    from omniload.workers.readers import index_file

    first = hub.push("org/corpus", _dataset(tmp_path, 1))
    options = StoreOptions(endpoint=hub.url)
    urls = list_matching("hf://datasets/org/corpus/data/*/*.parquet", options)
    assert len(urls) == FOLDERS * FILES and all(f"hf://datasets/org/corpus@{first}/data/" in u for u in urls)
    second = hub.push("org/corpus", _dataset(tmp_path, 2))  # every file changes
    files = Files(options)
    texts = [
        t for u in urls for shard in index_file(u, "parquet", "text", 0, files=files) for t in _texts(shard, files)
    ]
    files.close()
    expected = [t for f in range(FOLDERS) for i in range(FILES) for t in documents(40, 100 + f * 10 + i, 2, 60)]
    assert sorted(texts) == sorted(expected), "the listed commit's documents, not the new ones"
    assert all(f"@{second}/" in u for u in list_matching("hf://datasets/org/corpus/data/*/*.parquet", options))


def _texts(shard, files) -> list[str]:
    from omniload.workers.readers import iter_slices

    return [str(t) for piece in iter_slices(shard, "text", files=files) for t in piece]


@pytest.mark.parametrize(
    "pattern, says",
    [
        ("hf://datasets/org/missing/data/*.parquet", "no dataset repository 'org/missing' at http"),
        ("hf://datasets/org/corpus@nope/data/*/*.parquet", "dataset repository 'org/corpus' has no revision 'nope'"),
        ("hf://datasets/org/corpus/nothing/*.parquet", "(no such prefix)"),
    ],
)
def test_a_missing_repository_revision_or_folder_is_named(hub, tmp_path, pattern, says):
    from omniload.errors import ConfigError
    from omniload.storage.objects import list_matching
    from omniload.storage.urls import StoreOptions

    hub.push("org/corpus", _dataset(tmp_path, 1))
    with pytest.raises(ConfigError, match=re.escape(says)):
        list_matching(pattern, StoreOptions(endpoint=hub.url))
