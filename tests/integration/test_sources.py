"""Source formats and transforms end to end: pre-tokenized columns and files (Megatron, flat
token files), Hugging Face tokenizers; bad token files stop the job naming source, file and offset."""

from __future__ import annotations

import signal
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import psutil
import pytest
import tokenizers

import omniload
from omniload.order import split_sample_id
from omniload.workers.transforms import load_transform
from tests.corpus import write_arrow, write_jsonl, write_megatron, write_parquet, write_token_file
from tests.jobs import (
    PROBE,
    ROOT,
    collect,
    forkserver_of,
    omniload_cli,
    run_ranks,
    start_ranks,
    wait_connected,
    wait_written,
    workers_of,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_pretokenized_list_column_is_used_as_is(tmp_path):
    docs = [list(range(i, i + 5 + i % 7)) for i in range(100)]
    write_parquet(tmp_path / "tok.parquet", docs, column="ids")
    write_jsonl(tmp_path / "tok.jsonl", docs, column="ids")
    spec = {
        "sources": [
            {"name": "p", "path": str(tmp_path / "tok.parquet"), "column": "ids"},
            {"name": "j", "path": str(tmp_path / "tok.jsonl"), "column": "ids"},
        ],
        "seq_len": 32,
        "rows": 2,
        "workers": 2,
    }
    (rank,) = run_ranks(spec, world=1, out_dir=tmp_path)
    # every document arrives once per source, with its exact token count
    assert sum(rank["source_tokens"].values()) == 2 * sum(len(d) for d in docs)
    assert len(rank["sample_ids"]) == 200


def _word_tokenizer(folder: Path) -> Path:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "omniload": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_huggingface_tokenizer_file(tmp_path):
    _word_tokenizer(tmp_path)
    write_arrow(tmp_path / "t.arrow", ["hello world omniload"] * 30 + ["hello unknown"] * 10)
    spec = {
        "sources": [f"t={tmp_path}/t.arrow"],
        "seq_len": 8,
        "rows": 4,
        "tokenizer": str(tmp_path / "tokenizer.json"),
    }
    (rank,) = run_ranks(spec, world=1, out_dir=tmp_path)
    assert sum(rank["source_tokens"].values()) == 30 * 3 + 10 * 2


def test_the_vocabulary_is_the_workers_never_the_coordinators(tmp_path):
    """A real vocabulary is tens of MB: the coordinator checks it in a short-lived child, and a
    worker's lanes share one copy."""
    path = str(_word_tokenizer(tmp_path))
    assert load_transform(path) is load_transform(path)
    for name in ("a", "b", "c"):
        write_arrow(tmp_path / f"{name}.arrow", ["hello world omniload"] * 20)
    spec = {"sources": [f"{n}={tmp_path}/{n}.arrow" for n in "abc"], "seq_len": 8, "rows": 2, "workers": 1}
    with omniload.Job({**spec, "tokenizer": path}) as job:
        (rank,) = collect(start_ranks(job, 1, tmp_path))
        coordinator_maps = Path(f"/proc/{job._process.pid}/maps").read_text()
    assert sum(rank["source_tokens"].values()) == 3 * 20 * 3
    assert "tokenizers" not in coordinator_maps


def test_the_workers_of_a_job_share_the_tokenizer_their_forkserver_loaded(tmp_path):
    """With more than one worker, the forkserver parses the tokenizer.json before it forks any
    and the workers keep that copy: one restarted after the file is gone carries on, and no
    worker loads a library the forkserver lacks. With one worker the forkserver loads no
    tokenizer (it would hold a second copy)."""
    path = _word_tokenizer(tmp_path)
    for name in ("a", "b"):
        write_arrow(tmp_path / f"{name}.arrow", ["hello world omniload"] * 20)
    spec = {"sources": [f"{n}={tmp_path}/{n}.arrow" for n in "ab"], "seq_len": 8, "rows": 2, "tokenizer": str(path)}
    with omniload.Job({**spec, "workers": 1, "steps": 5}) as job:
        ranks = start_ranks(job, 1, tmp_path)
        (forkserver,) = forkserver_of(job)
        assert "tokenizers" not in Path(f"/proc/{forkserver.pid}/maps").read_text()
        collect(ranks)
    with omniload.Job({**spec, "workers": 2, "epochs": 0, "steps": 60, "seed": 1}) as job:
        ranks = start_ranks(job, 1, tmp_path, env={"PROBE_STEP_S": "0.02"})
        wait_connected(job, 1)
        wait_written(job)  # each source's worker has read and tokenized
        (forkserver,) = forkserver_of(job)
        preloaded = _libraries(forkserver.pid)
        loaded_after_fork = {worker.pid: _libraries(worker.pid) - preloaded for worker in workers_of(job)}
        path.unlink()
        victim = workers_of(job)[0]
        victim.send_signal(signal.SIGKILL)
        psutil.wait_procs([victim], timeout=5)
        (rank,) = collect(ranks)
        log = "\n".join(job.log_tail())
    assert "was killed by SIGKILL; restarting it at the source cursor" in log, log
    assert len(rank["hashes"]) == 60, log
    # what the workers import, the forkserver has imported once for all of them to share
    # (numpy.random among it, which numpy imports only on first use)
    assert loaded_after_fork and not any(loaded_after_fork.values()), loaded_after_fork


def _libraries(pid: int) -> set[str]:
    """The shared objects process `pid` has mapped."""
    paths = (line.split(maxsplit=5)[-1].strip() for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    return {path for path in paths if ".so" in Path(path).name}


_CACHED_IN_A_FORKED_CHILD = """
import sys
from concurrent.futures import ProcessPoolExecutor
from omniload.coordinator.pool.forkserver import forkserver_context, share_tokenizers
from omniload.coordinator.pool.worker_pool import stop_helpers
from omniload.workers.transforms import load_transform

share_tokenizers(sys.argv[1:])
with ProcessPoolExecutor(1, mp_context=forkserver_context()) as child:
    # the tokenizers already in the cache of a child forked from the forkserver
    print(child.submit(eval, "load_transform.cache_info().currsize", {"load_transform": load_transform}).result())
stop_helpers()
"""


def test_the_forkserver_loads_only_tokenizer_files_and_lives_through_those_that_fail(tmp_path):
    """A bad file is the indexing child's to report (naming the source): the forkserver must
    neither die of it nor stop loading the rest. Functions are never loaded there: the user's
    module may start threads on import, and the forkserver forks."""
    good = str(_word_tokenizer(tmp_path))
    (tmp_path / "broken.json").write_text("{not json")
    names = [str(tmp_path / "missing.json"), str(tmp_path / "broken.json"), good, "tests.transforms_for_tests:exit3"]
    done = subprocess.run(
        [sys.executable, "-c", _CACHED_IN_A_FORKED_CHILD, *names, "bytes"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1"]  # the good file, loaded before the child was forked


def _token_docs(n: int, seed: int, high: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, high, int(rng.integers(1, 30))).tolist() for _ in range(n)]


def test_megatron_flat_token_file_and_token_column_sources_deliver_every_document_as_written(tmp_path):
    eos = 50256
    docs = {
        0: _token_docs(150, 1, 50000),  # Megatron .bin/.idx, found by its name
        1: _token_docs(120, 2, eos),  # nanoGPT's train.bin: each document ends with eos
        2: _token_docs(90, 3, 50000),  # a parquet column of token-id lists
    }
    write_megatron(tmp_path / "mega" / "web_text_document", [[d] for d in docs[0]])
    write_token_file(tmp_path / "flat" / "train.bin", docs[1], eos)
    docs[1] = [[*d, eos] for d in docs[1]]
    write_parquet(tmp_path / "ids.parquet", docs[2], column="ids", row_group_size=20)
    spec = {
        "sources": [
            # the glob matches the .bin and its .idx: the .idx is read beside the .bin, not as a file of its own
            {"name": "mega", "path": str(tmp_path / "mega" / "*"), "format": "megatron", "vocab": 50304},
            f"flat={tmp_path}/flat/train.bin,format=tokens,eos={eos},vocab=50304",
            {"name": "col", "path": str(tmp_path / "ids.parquet"), "tokens": "ids"},
        ],
        "seq_len": 64,
        "rows": 2,
        "workers": 2,
    }
    (rank,) = run_ranks(spec, world=1, out_dir=tmp_path)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for step in rank["step_segments"]:
        for sid, length, crc in step:
            if sid < 0:
                continue
            source, ordinal, chunk = split_sample_id(sid)
            assert chunk == 0, "every document fits a row"
            expected = np.asarray(docs[source][ordinal], dtype=np.int64)
            assert (length, crc) == (len(expected), zlib.crc32(expected.tobytes())), (source, ordinal)
            seen[source].append(ordinal)
    assert {s: sorted(o) for s, o in seen.items()} == {s: list(range(len(d))) for s, d in docs.items()}


def _launch_with(tmp_path, source: str, *flags: str):
    return omniload_cli(
        "launch", "--source", source, "--seq-len", "32", *flags, "--", sys.executable, str(PROBE), str(tmp_path / "o")
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda idx: idx[:-3], "is truncated: 439 bytes, its header (20 sequences, 20 documents) needs 442"),
        (lambda idx: b"NOTANIDX\x00" + idx[9:], "does not start with Megatron's"),
    ],
)
def test_a_damaged_megatron_index_stops_the_launch_with_exit_2_naming_source_and_file(tmp_path, damage, message):
    bin_path = write_megatron(tmp_path / "d", [[d] for d in _token_docs(20, 4, 1000)])
    idx = tmp_path / "d.idx"
    idx.write_bytes(damage(idx.read_bytes()))
    result = _launch_with(tmp_path, f"mega={bin_path}")
    assert result.returncode == 2, result.stderr
    assert f"source 'mega': {bin_path}: index {idx} {message}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_an_id_beyond_the_vocabulary_stops_the_job_naming_source_file_and_offset(tmp_path):
    docs = _token_docs(40, 5, 1000)
    docs[17][3] = 4000
    offset = sum(len(d) + 1 for d in docs[:17]) + 3
    path = write_token_file(tmp_path / "train.bin", docs, eos=0)
    result = _launch_with(tmp_path, f"flat={path},format=tokens,eos=0,vocab=1024")
    assert result.returncode == 2, result.stderr
    assert f"source 'flat': {path}: " in result.stderr, result.stderr
    assert f"token id 4000 at token offset {offset}" in result.stderr, result.stderr
    assert "is not below the vocabulary size 1024 (vocab=, else the source" in result.stderr, result.stderr
