"""`omniload trace`: a step's documents recomputed from the checkpoint folder equal what the ranks received."""

from __future__ import annotations

import gzip
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import omniload
from omniload.coordinator.checkpoint.folder import last_position, snapshot_steps
from omniload.coordinator.observe.trace import Traced, trace_step, trace_to_dict
from tests.corpus import documents, make_mixed_corpus, mixed_sources, write_parquet
from tests.jobs import collect, omniload_cli, run_ranks, start_ranks, wait_for_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SEQ_LEN = 64
STEPS = 22
_COLUMNS = {"code": "content"}  # the other sources' text is in "text" (tests/corpus.py)
_ROWS_PER_PART = {"parquet": 50, "arrow": 40}  # the corpus' row groups and record batches


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A finished 2-rank job with a checkpoint folder, and what each rank received."""
    root = tmp_path_factory.mktemp("trace")
    corpus = make_mixed_corpus(root)
    folder = root / "ckpt"
    spec = {
        "sources": mixed_sources(corpus),
        "seq_len": SEQ_LEN,
        "rows": 2,
        "workers": 3,
        "seed": 5,
        "epochs": 0,
        "steps": STEPS,
        "checkpoint_dir": str(folder),
        "snapshot_every": 8,
        "keep_snapshots": 3,
    }
    ranks = run_ranks(spec, world=2, out_dir=root)
    assert last_position(folder).step == STEPS
    return corpus, folder, ranks


def _received(rank: dict, step: int) -> list[list[int]]:
    """[sample_id, tokens, crc32] of each non-padding segment the rank received at `step`."""
    return [segment for segment in rank["step_segments"][rank["steps"].index(step)] if segment[0] >= 0]


def _steps_to_trace(folder: Path) -> list[int]:
    """Step 0 (from the job's start, checked against snapshot 1), steps at and after the newest
    snapshot and before it (replayed from an older one), and the last step. Which snapshots
    exist depends on the disk's pace: steps that queue up behind a write share one snapshot."""
    kept = snapshot_steps(folder)
    assert kept[0] == 1 and len(kept) >= 2, kept  # the first position is always snapshotted
    newest = kept[-1]
    assert newest <= STEPS - 3, kept
    return sorted({0, 2, newest - 1, newest, newest + 2, STEPS - 1})


def test_traced_steps_equal_what_every_rank_received(job):
    _, folder, ranks = job
    for step in _steps_to_trace(folder):
        trace = trace_step(folder, step)
        assert trace.snapshot == max((s for s in snapshot_steps(folder) if s <= step), default=None)
        assert [r.dp_rank for r in trace.ranks] == [0, 1] and [r.ranks for r in trace.ranks] == [[0], [1]]
        for rank in trace.ranks:
            want = _received(ranks[rank.dp_rank], step)
            assert [s.sample_id for s in rank.segments] == [sid for sid, _, _ in want], f"step {step} rank {rank}"
            assert [s.tokens for s in rank.segments] == [n for _, n, _ in want]
            assert sum(s.tokens for s in rank.segments) + rank.padding == 2 * SEQ_LEN


def test_file_and_row_point_at_the_document_the_rank_received(job):
    _, folder, ranks = job
    formats = set()
    for step in _steps_to_trace(folder):
        for rank in trace_step(folder, step).ranks:
            for segment, (_, _, crc) in zip(rank.segments, _received(ranks[rank.dp_rank], step)):
                tokens = _tokens_of(segment)
                chunk = tokens[segment.chunk * SEQ_LEN : (segment.chunk + 1) * SEQ_LEN]
                assert len(chunk) == segment.tokens and zlib.crc32(chunk.tobytes()) == crc, segment
                assert segment.part == segment.row // _ROWS_PER_PART.get(segment.format, 1 << 40), segment
                formats.add(segment.format)
    assert formats == {"parquet", "jsonl", "arrow"}, formats


def test_cli_prints_a_table_and_json_and_maps_a_global_rank(job):
    _, folder, ranks = job
    step = snapshot_steps(folder)[-1] + 2
    table = omniload_cli("trace", "--checkpoint-dir", str(folder), "--step", str(step), "--rank", "1")
    assert table.returncode == 0, table.stderr
    assert f"step {step} (from snapshot {step - 2}, 2 steps replayed; dp 2, world 2)" in table.stdout
    assert "dp rank 1 (ranks 1)" in table.stdout and "dp rank 0" not in table.stdout
    for sid, _, _ in _received(ranks[1], step):
        assert f" {sid} " in table.stdout
    printed = omniload_cli("trace", "--checkpoint-dir", str(folder), "--step", str(step), "--json")
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout) == trace_to_dict(trace_step(folder, step))


def test_steps_outside_the_folder_are_refused_naming_the_traceable_range(job, tmp_path):
    _, folder, _ = job
    with pytest.raises(omniload.ConfigError, match=f"step {STEPS}.*steps 0 to {STEPS - 1} can be traced"):
        trace_step(folder, STEPS)
    newest = snapshot_steps(folder)[-1]
    pruned = tmp_path / "pruned"  # what the job leaves with --keep-snapshots 1: the newest snapshot, its log
    pruned.mkdir()
    for name in (f"snapshot-{newest:010d}.json", f"deltas-{newest:010d}.log"):
        shutil.copy(folder / name, pruned / name)
    traceable = f"steps {newest} to {STEPS - 1} can be traced"
    with pytest.raises(omniload.ConfigError, match=rf"step {newest - 1} .*{traceable}.*--keep-snapshots"):
        trace_step(pruned, newest - 1)
    result = omniload_cli("trace", "--checkpoint-dir", str(pruned), "--step", "0")
    assert result.returncode == 2 and traceable in result.stderr, result.stderr


def test_a_changed_file_is_refused_naming_it(job):
    corpus, folder, _ = job
    path = Path(corpus["web"]).parent / "b.parquet"
    original = path.read_bytes()
    try:
        write_parquet(path, documents(210, 2))
        result = omniload_cli("trace", "--checkpoint-dir", str(folder), "--step", "16")
    finally:
        path.write_bytes(original)
    assert result.returncode == 2, result.stderr
    assert "source 'web': " in result.stderr and "b.parquet changed" in result.stderr, result.stderr


def test_a_step_planned_by_a_resume_at_another_size_traces_as_that_job_planned_it(tmp_path):
    corpus = make_mixed_corpus(tmp_path / "data")
    folder = tmp_path / "ckpt"
    spec = {
        "sources": mixed_sources(corpus),
        "seq_len": SEQ_LEN,
        "rows": 2,
        "workers": 3,
        "seed": 6,
        "epochs": 0,
        "snapshot_every": 50,
    }
    with omniload.Job({**spec, "checkpoint_dir": str(folder)}) as first_job:
        first = collect(start_ranks(first_job, 2, tmp_path, max_steps=6))
        wait_for_checkpoint(folder, 6, timeout=10)
    with omniload.Job({**spec, "resume": str(folder), "steps": 10}) as second_job:
        second = collect(start_ranks(second_job, 3, tmp_path))
    assert second[0]["steps"] == [6, 7, 8, 9]
    # step 6 was planned at dp 3, but the snapshot before it (step 1) is of dp 2: refused
    with pytest.raises(omniload.ConfigError, match="does not reproduce the snapshot of step 7"):
        trace_step(folder, 6)
    for step, ranks, size in ((3, first, 2), (8, second, 3)):
        trace = trace_step(folder, step)
        assert trace.layout["dp"] == size
        for rank in trace.ranks:
            assert [s.sample_id for s in rank.segments] == [sid for sid, _, _ in _received(ranks[rank.dp_rank], step)]


def _tokens_of(segment: Traced) -> np.ndarray:
    """The document at the segment's file and row, tokenized as the job did (bytes), as int64."""
    column = _COLUMNS.get(segment.source, "text")
    if segment.format == "parquet":
        text = pq.read_table(segment.file, columns=[column]).column(column)[segment.row].as_py()
    elif segment.format == "arrow":
        with pa.ipc.open_file(segment.file) as reader:
            text = reader.read_all().column(column)[segment.row].as_py()
    else:
        opener = gzip.open if segment.file.endswith(".gz") else open
        with opener(segment.file, "rt") as f:
            text = json.loads([line for line in f if line.strip()][segment.row])[column]
    return np.frombuffer(text.encode(), np.uint8).astype(np.int64)
