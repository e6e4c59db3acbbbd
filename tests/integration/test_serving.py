"""Several rank processes over one real job: disjoint data, exactly once, mixture by tokens."""

from __future__ import annotations

import math

import pytest

from omniload.formats.shards import detect_format
from omniload.order import sample_id
from omniload.workers.readers import index_file, read_shard
from tests.corpus import mixed_sources
from tests.jobs import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_four_ranks_disjoint_at_most_once_and_weighted_by_tokens(corpus, tmp_path):
    weights = (0.6, 0.3, 0.1)
    spec = {"sources": mixed_sources(corpus, weights), "seq_len": 128, "rows": 1, "workers": 4, "seed": 3, "steps": 200}
    ranks = run_ranks(spec, world=4, out_dir=tmp_path)

    assert [len(r["hashes"]) for r in ranks] == [200] * 4, "every rank gets a batch at every step"
    ids = [set(r["sample_ids"]) for r in ranks]
    for r, rank in enumerate(ranks):
        assert len(rank["sample_ids"]) == len(ids[r]), f"rank {r} got a sample twice"
        for other in range(r + 1, 4):
            assert not ids[r] & ids[other], f"ranks {r} and {other} share samples"
    tokens = [sum(r["source_tokens"].get(str(s), 0) for r in ranks) for s in range(3)]
    shares = [t / sum(tokens) for t in tokens]
    assert shares == pytest.approx(weights, abs=0.02), shares


def _expected_ids(sources: list[dict], seq_len: int) -> set[int]:
    """Every (document, chunk) id of one epoch, computed from the files directly."""
    import glob

    expected = set()
    for s, source in enumerate(sources):
        ordinal = 0
        for path in sorted(glob.glob(source["path"])):
            for shard in index_file(path, detect_format(path), source.get("column", "text"), ordinal):
                for i, text in enumerate(read_shard(shard, source.get("column", "text"))):
                    chunks = math.ceil(len(text.encode()) / seq_len)
                    expected |= {sample_id(s, shard.first_ordinal + i, c) for c in range(chunks)}
                ordinal += shard.rows
    return expected


@pytest.mark.parametrize("workers", [1, 5], ids=["one-worker-serves-all-sources", "several-lanes-per-source"])
def test_one_epoch_delivers_every_document_chunk_exactly_once(corpus, tmp_path, workers):
    sources = mixed_sources(corpus)
    spec = {"sources": sources, "seq_len": 256, "rows": 2, "workers": workers, "seed": 11, "epochs": 1}
    ranks = run_ranks(spec, world=2, out_dir=tmp_path)

    assert len(ranks[0]["hashes"]) == len(ranks[1]["hashes"]) > 0, "equal step counts when the data ends"
    delivered = ranks[0]["sample_ids"] + ranks[1]["sample_ids"]
    assert len(delivered) == len(set(delivered)), "a sample was delivered twice"
    assert set(delivered) == _expected_ids(sources, 256), "a sample was lost"


def test_64_ranks_of_one_job_get_every_step_and_never_the_same_sample(corpus):
    import threading

    import omniload

    world, steps = 64, 5
    spec = {"sources": mixed_sources(corpus), "seq_len": 64, "rows": 1, "workers": 3, "seed": 1, "steps": steps}
    seen: dict[int, list[list[int]]] = {}

    def rank(r: int, job: omniload.Job) -> None:
        with omniload.connect(job.addr, job.token, rank=r, world_size=world) as loader:
            seen[r] = [[i for i in batch["sample_id"].tolist() if i >= 0] for batch in loader]

    with omniload.Job(spec) as job:
        threads = [threading.Thread(target=rank, args=(r, job)) for r in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert sorted(seen) == list(range(world)) and all(len(batches) == steps for batches in seen.values())
    delivered = [i for batches in seen.values() for batch in batches for i in batch]
    assert delivered and len(delivered) == len(set(delivered)), "a sample went to two ranks or twice to one"
