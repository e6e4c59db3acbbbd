"""The checkpoint folder: snapshots, deltas, torn records, corrupt snapshots (real files)."""

from __future__ import annotations

import logging

import pytest

from omniload.coordinator.checkpoint.folder import CheckpointWriter, explain_mismatch, last_position
from omniload.state import STATE_VERSION

JOB = {"spec": {"seq_len": 64, "seed": 1}, "files": {"web": [["a.parquet", 100, 10]]}}


def _state(step: int) -> dict:
    return {
        "version": STATE_VERSION,
        "fingerprint": "f",
        "step": step,
        "cursors": {"web": [step // 3, step % 3], "code": [0, step]},
        "spreads": {
            "web": {
                "start": [step // 6, 0],
                "clock": 100 * step,
                "horizon": 1 << 20,
                "fill": 1 << 16,
                "frontier": [7 * step, 4096 * step],
                "passed": [[7 * step - 1, 4096]] if step % 2 else [],
                "ended": False,
                "drawn_since_end": 0,
            },
            "code": None,
        },
        "passes": [step * 1.5, step * 0.25],
        "weights": [0.6, 0.4],
        "tokens": 100 * step,
        "dropped": 0,
        "carry": [[0, 4096 * step + k, 10 + k, 0, -1, k % 2, step, k] for k in range(step % 4)],
        "live": [[5, {"web": 1.0, "code": 0.0}]] if step >= 5 else [],
    }


def _write(folder, steps, every=4, keep=2, first=1, notes=None):
    errors = []
    writer = CheckpointWriter(folder, every, keep, JOB, errors.append)
    for step in range(first, steps + 1):
        writer.write(_state(step), 2, (notes or {}).get(step))
        writer.flush()  # one record a step, as when the disk keeps up
    writer.close()
    assert not errors
    return writer


def test_a_delta_records_facts_only_and_restore_names_the_step_to_replay_to(tmp_path):
    _write(tmp_path, 11)
    found = last_position(tmp_path)
    assert found.state == _state(8) and found.job == JOB and found.dp == 2  # the newest snapshot
    assert found.step == 11 and found.replay == 3
    assert found.live == []  # the change at step 5 is in the snapshot already


def test_live_changes_after_the_snapshot_come_from_the_log(tmp_path):
    _write(tmp_path, 7)
    found = last_position(tmp_path)
    assert found.state["step"] == 4 and found.step == 7
    assert found.live == [[5, {"web": 1.0, "code": 0.0}]]


@pytest.mark.parametrize("k", range(0, 4))
def test_snapshot_plus_k_records_reaches_every_step(tmp_path, k):
    _write(tmp_path, 8 + k)
    found = last_position(tmp_path)
    assert found.state["step"] == 8 and found.step == 8 + k


def test_a_step_costs_a_few_bytes_of_log(tmp_path):
    _write(tmp_path, 400, every=100)
    logs = sorted(tmp_path.glob("deltas-*.log"))
    per_step = logs[-1].stat().st_size / 100
    assert per_step <= 64, per_step


def test_steps_queued_behind_a_write_go_out_as_one_record(tmp_path):
    errors = []
    writer = CheckpointWriter(tmp_path, 1000, 2, JOB, errors.append)
    for step in range(1, 201):
        writer.write(_state(step), 2)
    writer.close()
    records = (tmp_path / f"deltas-{1:010d}.log").read_bytes().count(b"\n")
    assert not errors and records < 199 and last_position(tmp_path).step == 200


def test_a_stalled_disk_holds_at_most_one_snapshot_and_two_records(tmp_path, monkeypatch):
    """What waits for a slow disk is bounded: the newest snapshot replaces an older pending one,
    and the log still reaches the last step with every live change."""
    import threading
    import time

    from omniload.coordinator.checkpoint import folder as checkpoint

    gate = threading.Event()
    real_append = checkpoint.CheckpointWriter._append
    monkeypatch.setattr(
        checkpoint.CheckpointWriter, "_append", lambda self, record: (gate.wait(), real_append(self, record))
    )
    errors = []
    writer = CheckpointWriter(tmp_path, 4, 3, JOB, errors.append)
    writer.write(_state(1), 2)
    while not writer._busy:  # the writer thread took step 1 and now blocks on the disk
        time.sleep(0.001)
    changes = {step: {"web": step / 100, "code": 1.0} for step in range(7, 40, 7)}
    for step in range(2, 40):
        state = _state(step)
        state["live"] = [[at, w] for at, w in changes.items() if at <= step][-1:]  # the change in force
        writer.write(state, 2)
        snapshot = writer._pending.snapshot
        assert snapshot is None or snapshot[0]["step"] == step - step % 4, "only the newest snapshot waits"
    gate.set()
    writer.close()
    found = last_position(tmp_path)
    assert not errors and found.step == 39 and found.state["step"] == 36 and found.live == []
    assert [p.name for p in sorted(tmp_path.glob("snapshot-*.json"))] == [
        "snapshot-0000000001.json",
        "snapshot-0000000036.json",
    ]
    step, live = checkpoint._read_log(tmp_path, 1)  # replaying from the first snapshot meets every change
    assert step == 39 and live == [[at, w] for at, w in changes.items()]


def test_any_error_of_the_writer_reaches_the_job_once(tmp_path, monkeypatch):
    """Not only a full disk: a bug in the writer must stop the job too, never leave it
    training on without checkpoints. Writes after it are dropped: the job is stopping, and a
    second error there would hide the first."""
    from omniload.coordinator.checkpoint import folder as checkpoint

    def broken(self, *args):
        raise ValueError("a bug in a snapshot")

    monkeypatch.setattr(checkpoint.CheckpointWriter, "_snapshot", broken)
    errors = []
    writer = CheckpointWriter(tmp_path, 4, 2, JOB, errors.append)
    writer.write(_state(1), 2)
    writer._thread.join(5)
    writer.write(_state(2), 2)
    writer.close()
    assert [type(e) for e in errors] == [ValueError]


def test_torn_last_record_is_ignored_and_reported(tmp_path, caplog):
    _write(tmp_path, 11)
    log = sorted(tmp_path.glob("deltas-*.log"))[-1]
    data = log.read_bytes()
    log.write_bytes(data[: len(data) - 7])  # the write of step 11 was cut short
    with caplog.at_level(logging.WARNING, logger="omniload"):
        found = last_position(tmp_path)
    assert found.step == 10
    assert "torn or corrupt" in caplog.text and "step 10" in caplog.text


def test_corrupt_snapshot_falls_back_to_the_one_before(tmp_path, caplog):
    _write(tmp_path, 11)
    newest = sorted(tmp_path.glob("snapshot-*.json"))[-1]
    newest.write_bytes(newest.read_bytes()[:-20] + b"garbage garbage gar")
    with caplog.at_level(logging.WARNING, logger="omniload"):
        found = last_position(tmp_path)
    assert found.state == _state(4) and found.step == 11, "the older snapshot and the log after it reach step 11"
    assert found.live == [[5, {"web": 1.0, "code": 0.0}]]
    assert newest.name in caplog.text and "older snapshot" in caplog.text


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_newest_snapshots_and_their_logs_are_kept(tmp_path, keep):
    _write(tmp_path, 30, every=5, keep=keep)
    snapshots = sorted(p.name for p in tmp_path.glob("snapshot-*.json"))
    assert snapshots == [f"snapshot-{s:010d}.json" for s in (30, 25, 20)[:keep][::-1]]
    logs = sorted(int(p.stem.split("-")[1]) for p in tmp_path.glob("deltas-*.log"))
    assert logs and min(logs) == int(snapshots[0][9:19])
    assert last_position(tmp_path).step == 30


def test_a_resumed_run_starts_with_a_snapshot_and_its_note(tmp_path):
    _write(tmp_path, 6)
    _write(tmp_path, 13, first=7, keep=10, notes={7: "allow_changed_data: resumed"})
    assert (tmp_path / f"snapshot-{7:010d}.json").exists()
    assert b"allow_changed_data: resumed" in (tmp_path / f"snapshot-{7:010d}.json").read_bytes()
    assert last_position(tmp_path).step == 13


def test_a_failed_write_is_reported_from_the_writer_thread(tmp_path):
    (tmp_path / f"deltas-{1:010d}.log").mkdir()  # the log cannot be opened: as a full disk would fail
    errors = []
    writer = CheckpointWriter(tmp_path, 4, 2, JOB, errors.append)
    writer.write(_state(1), 2)  # returns at once: the disk is the writer thread's
    writer.write(_state(2), 2)
    writer.close()
    assert len(errors) == 1 and isinstance(errors[0], IsADirectoryError)


def test_state_size_does_not_grow_with_samples_read(tmp_path):
    _write(tmp_path, 400, every=100, keep=10)
    sizes = [p.stat().st_size for p in sorted(tmp_path.glob("snapshot-*.json"))]
    assert max(sizes) - min(sizes) < 64  # only the digits of the numbers grow


def test_empty_folder_has_no_position(tmp_path):
    assert last_position(tmp_path) is None


def test_mismatch_names_what_changed():
    job = {"spec": {"seq_len": 128, "seed": 1}, "files": {"web": [["a.parquet", 120, 12], ["b.parquet", 5, 1]]}}
    text = explain_mismatch(JOB, job)
    assert "spec seq_len: checkpoint 64, job 128" in text
    assert "a.parquet changed" in text and "b.parquet is new" in text


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"version": STATE_VERSION, "step": 1}, "lacks"),
        ({**_state(1), "version": 99}, "version 99"),
        ({**_state(1), "version": 1}, "version 1 is not supported"),
        ({**_state(1), "step": -1}, "field 'step' is malformed: expected a count, got -1"),
        ({**_state(1), "step": "1"}, "field 'step' is malformed: expected int, got str"),
        ({**_state(1), "cursors": {"web": [0], "code": [0, 1]}}, "field 'cursors' is malformed"),
        ({**_state(1), "spreads": {"web": None}}, "field 'spreads' is malformed: names"),
        ({**_state(1), "spreads": {"web": {"start": [0, 0]}, "code": None}}, "field 'spreads' is malformed"),
        ({**_state(1), "passes": [1.0]}, "field 'passes' is malformed: 1 passes and 2 weights for 2 sources"),
        ({**_state(1), "weights": [0.6, float("nan")]}, "field 'weights' is malformed: expected a finite number"),
        ({**_state(3), "carry": [[0, 1, 2]]}, "field 'carry' is malformed: a carried segment has 8 fields, got 3"),
        ({**_state(5), "live": [[5, {"web": "1"}]]}, "field 'live' is malformed"),
    ],
)
def test_bad_states_are_refused_naming_the_field(bad, message):
    from omniload.errors import ConfigError
    from omniload.state import check_state

    with pytest.raises(ConfigError, match=message):
        check_state(bad, "test")


@pytest.mark.parametrize("step", range(8))
def test_a_position_round_trips_through_its_typed_form_byte_for_byte(step):
    import orjson

    from omniload.state import LoaderState

    state = _state(step)
    assert orjson.dumps(LoaderState.from_json(state, "test").to_json()) == orjson.dumps(state)


def test_the_first_snapshot_is_kept_when_the_disk_falls_behind():
    """A slow disk merges pending snapshots into the newest, but never drops the job's first:
    early steps are traced and resumed from it."""
    from omniload.coordinator.checkpoint.folder import _Pending

    pending = _Pending()
    pending.add(1, [], None, ({"step": 1}, 2, None), first=True)
    for step in range(2, 9):
        pending.add(step, [], None, ({"step": step}, 2, None) if step == 8 else None)
    assert pending.snapshot is not None and pending.snapshot[0]["step"] == 1
    assert pending.after["s"] == 8, "the log still covers the steps after it"
    later = _Pending()
    later.add(8, [], None, ({"step": 8}, 2, None))
    later.add(16, [], None, ({"step": 16}, 2, None))
    assert later.snapshot is not None and later.snapshot[0]["step"] == 16, "later ones merge into the newest"
