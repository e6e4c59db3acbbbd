"""The checkpoint folder: snapshots, deltas, torn records, corrupt snapshots (real files)."""
from __future__ import annotations

import logging

import pytest

from omniload.coordinator.checkpoint import CheckpointWriter, apply, diff, explain_mismatch, last_position
from omniload.state import STATE_VERSION

JOB = {"spec": {"seq_len": 64, "seed": 1}, "files": {"web": [["a.parquet", 100, 10]]}}


def _state(step: int) -> dict:
    return {"version": STATE_VERSION, "fingerprint": "f", "step": step,
            "cursors": {"web": [step // 3, step % 3], "code": [0, step]},
            "windows": {"web": [step // 6, 0, step % 6, [step % 6 + 2] if step % 2 else []], "code": None},
            "passes": [step * 1.5, step * 0.25], "weights": [0.6, 0.4], "tokens": 100 * step, "dropped": 0,
            "carry": [[0, 4096 * step + k, 10 + k, 0, -1, k % 2, step, k] for k in range(step % 4)],
            "live": [[5, {"web": 1.0, "code": 0.0}]] if step >= 5 else []}


def _write(folder, steps, every=4):
    writer = CheckpointWriter(folder, every, JOB)
    for step in range(1, steps + 1):
        writer.write(_state(step))
    writer.close()


def test_deltas_reproduce_every_state():
    for step in range(1, 12):
        assert apply(_state(step), diff(_state(step), _state(step + 1))) == _state(step + 1)


def test_restore_gives_the_last_step(tmp_path):
    _write(tmp_path, 11)
    state, job = last_position(tmp_path)
    assert state == _state(11) and job == JOB


def test_torn_last_record_is_ignored_and_reported(tmp_path, caplog):
    _write(tmp_path, 11)
    log = sorted(tmp_path.glob("deltas-*.log"))[-1]
    data = log.read_bytes()
    log.write_bytes(data[: len(data) - 7])  # the write of step 11 was cut short
    with caplog.at_level(logging.WARNING, logger="omniload"):
        state, _ = last_position(tmp_path)
    assert state == _state(10)
    assert "torn or corrupt" in caplog.text and "step 10" in caplog.text


def test_corrupt_snapshot_falls_back_to_the_one_before(tmp_path, caplog):
    _write(tmp_path, 11)
    newest = sorted(tmp_path.glob("snapshot-*.json"))[-1]
    newest.write_bytes(newest.read_bytes()[:-20] + b"garbage garbage gar")
    with caplog.at_level(logging.WARNING, logger="omniload"):
        state, _ = last_position(tmp_path)
    assert state == _state(11), "the older snapshot and the deltas after it still reach step 11"
    assert newest.name in caplog.text and "older snapshot" in caplog.text


def test_state_size_does_not_grow_with_samples_read(tmp_path):
    _write(tmp_path, 400, every=100)
    sizes = [p.stat().st_size for p in sorted(tmp_path.glob("snapshot-*.json"))]
    assert max(sizes) - min(sizes) < 64  # only the digits of the numbers grow


def test_empty_folder_has_no_position(tmp_path):
    assert last_position(tmp_path) is None


def test_mismatch_names_what_changed():
    job = {"spec": {"seq_len": 128, "seed": 1},
           "files": {"web": [["a.parquet", 120, 12], ["b.parquet", 5, 1]]}}
    text = explain_mismatch(JOB, job)
    assert "spec seq_len: checkpoint 64, job 128" in text
    assert "a.parquet changed" in text and "b.parquet is new" in text


@pytest.mark.parametrize("bad, message", [({"version": STATE_VERSION, "step": 1}, "lacks"),
                                          ({**_state(1), "version": 99}, "version 99"),
                                          ({**_state(1), "version": 1}, "version 1 is not supported")])
def test_bad_states_are_refused(bad, message):
    from omniload.errors import ConfigError
    from omniload.state import check_state

    with pytest.raises(ConfigError, match=message):
        check_state(bad, "test")
