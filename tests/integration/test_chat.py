"""Chat sources end to end: a real job whose batches' labels are -100 exactly outside the
assistants' replies, the same on a rerun and after a resume; long conversations cut at a turn
boundary and counted in status; a bad conversation stops the job naming source, file and row."""

from __future__ import annotations

import json
import sys
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import omniload
from omniload.order import split_sample_id
from tests.corpus import documents, write_parquet
from tests.jobs import PROBE, collect, omniload_cli, run_ranks, start_ranks, wait_for_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SEQ_LEN = 160
LABELS = {"PROBE_LABELS": "1"}


def _conversations(n: int, seed: int, unfit: bool = False) -> list[list[dict[str, str]]]:
    """Conversations of 1-4 exchanges, some with a system prompt; every 7th too long for SEQ_LEN,
    and with `unfit`, conversation 5 has a first reply beyond SEQ_LEN."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(50)]
    out = []
    for i in range(n):
        turns = 4 if i % 7 == 0 else int(rng.integers(1, 3))
        size = 6 if i % 7 == 0 else 3
        if unfit and i == 5:
            turns, size = 1, 40
        chat = [{"role": "system", "content": "be kind"}] if i % 3 == 0 else []
        for _ in range(turns):
            chat.append({"role": "user", "content": " ".join(rng.choice(words, size))})
            chat.append({"role": "assistant", "content": " ".join(rng.choice(words, size))})
        out.append(chat)
    return out


def _expected(chat: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """(input_ids, labels, truncated) as the ranks must get them: ChatML written out by hand, the
    bytes tokenizer, labels the next token where it is part of a reply, cut after the last
    whole reply within SEQ_LEN; None when no reply fits (dropped)."""
    ids: list[int] = []
    trained: list[bool] = []
    reply_ends = []
    for m in chat:
        reply = m["role"] == "assistant"
        for text, train in [(f"<|im_start|>{m['role']}\n", False), (m["content"] + "<|im_end|>", reply), ("\n", False)]:
            ids += list(text.encode())
            trained += [train] * len(text.encode())
        if reply:
            reply_ends.append(len(ids))
    truncated = len(ids) > SEQ_LEN
    if truncated:
        if reply_ends[0] > SEQ_LEN:
            return None
        stop = max(end for end in reply_ends if end <= SEQ_LEN)
        ids, trained = ids[:stop], trained[:stop]
    labels = [ids[i + 1] if trained[i + 1] else -100 for i in range(len(ids) - 1)] + [-100]
    return np.asarray(ids, np.int64), np.asarray(labels, np.int64), truncated


def _crc(values: np.ndarray) -> int:
    return zlib.crc32(values.astype(np.int64).tobytes())


@pytest.fixture
def chat_spec(tmp_path):
    messages = _conversations(60, seed=1, unfit=True)
    sharegpt = _conversations(40, seed=2)
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in messages) + "\n")
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    table = pa.table(
        {"conversations": [[{"from": names[m["role"]], "value": m["content"]} for m in c] for c in sharegpt]}
    )
    pq.write_table(table, tmp_path / "sharegpt.parquet", row_group_size=15)
    write_parquet(tmp_path / "web.parquet", documents(80, seed=3, max_words=40))
    spec = {
        "sources": [
            {"name": "chat", "path": str(tmp_path / "chat.jsonl"), "kind": "chat"},
            f"share={tmp_path}/sharegpt.parquet,kind=chat,weight=0.5",
            {"name": "web", "path": str(tmp_path / "web.parquet"), "weight": 0.5},
        ],
        "seq_len": SEQ_LEN,
        "rows": 2,
        "workers": 2,
        "seed": 5,
    }
    return spec, {0: messages, 1: sharegpt}


def test_labels_are_ignored_exactly_outside_the_replies_the_same_on_a_rerun(chat_spec, tmp_path):
    spec, chats = chat_spec
    (rank,) = run_ranks(spec, 1, tmp_path, env=LABELS)
    seen: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
    for step in rank["step_labels"]:
        for sid, length, ids_crc, labels_crc in step:
            if sid < 0:
                continue
            source, ordinal, chunk = split_sample_id(sid)
            seen[source].add(ordinal)
            if source == 2:  # text: trained on every next token within the document
                continue
            expected = _expected(chats[source][ordinal])
            assert expected is not None, "a conversation with no reply within seq_len is dropped"
            ids, labels, _ = expected
            assert chunk == 0 and length == len(ids), "a conversation is one segment, never split"
            assert (ids_crc, labels_crc) == (_crc(ids), _crc(labels)), (source, ordinal)
    assert seen == {0: set(range(60)) - {5}, 1: set(range(40)), 2: set(range(80))}, "every document once"
    (again,) = run_ranks(spec, 1, tmp_path, env=LABELS)
    assert again["hashes"] == rank["hashes"] and again["step_labels"] == rank["step_labels"]


def test_long_conversations_are_counted_in_status_and_resume_repeats_the_run(chat_spec, tmp_path):
    spec, chats = chat_spec
    spec = {**spec, "epochs": 0, "steps": 40}
    reference = run_ranks(spec, 2, tmp_path, env=LABELS)
    folder = tmp_path / "ckpt"
    with omniload.Job({**spec, "checkpoint_dir": str(folder)}) as job:
        collect(start_ranks(job, 2, tmp_path, max_steps=15, env=LABELS))
        assert wait_for_checkpoint(folder, 15, timeout=10) == 15
        figures = {s["name"]: s for s in job.status()["sources"]}
    long_ones = sum(e[2] for e in map(_expected, chats[0]) if e is not None)
    assert long_ones and figures["chat"]["chats_truncated"] >= long_ones  # an epoch of "chat" in 15 steps
    assert figures["chat"]["chats_dropped"] >= 1 and figures["web"]["chats_truncated"] == 0
    with omniload.Job({**spec, "resume": str(folder)}) as job:
        resumed = collect(start_ranks(job, 2, tmp_path, env=LABELS))
    for rank in range(2):
        assert resumed[rank]["steps"][0] == 15
        assert resumed[rank]["hashes"] == reference[rank]["hashes"][15:], f"rank {rank} differs after resume"


def test_a_row_with_an_unknown_role_stops_the_job_with_exit_2_naming_source_file_and_row(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 9
    rows.insert(4, {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]})
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = omniload_cli(
        "launch",
        "--source",
        f"chat={path},kind=chat",
        "--seq-len",
        "64",
        "--",
        sys.executable,
        str(PROBE),
        str(tmp_path / "o"),
    )
    assert result.returncode == 2, result.stderr
    assert f"source 'chat': {path}: the lines from 1, row 4: message 1 has role 'robot'" in result.stderr, result.stderr
