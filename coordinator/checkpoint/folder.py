"""The checkpoint folder: a full snapshot now and then, and a log of facts in between.

    snapshot-<step>.json   the position after <step> steps, the spec and file list, and the
                           data-parallel size that planned the steps after it
    deltas-<step>.log      after that snapshot, a line per group of consumed steps:
                           "<crc32 hex> <json>", the json {"s": steps consumed} plus, when
                           they happened, "live" (live mixture changes) and "note"

Every step is a pure function of spec, seed, files and the live mixture changes, so a delta
records only what cannot be recomputed: how far every rank has consumed, and those changes.
Restore takes the newest snapshot that reads cleanly and the records after it while each is
intact (`last_position`); the coordinator then replays the planner from the snapshot to the
last consumed step. A torn record or a corrupt snapshot costs steps, never correctness.

Writes happen on a writer thread: the event loop hands positions over and never waits for the
disk. What queues up while a write is under way goes out as one record and one fsync, so on a
slow disk the log holds fewer, larger steps, and a crash loses at most the records not yet
synced (a restored job then resumes a little earlier; ranks that restore their own state with
load_state_dict are not affected). Snapshots are atomic (temporary file, fsync, rename, fsync
of the folder); once one is durable, all but the newest `keep` snapshots and the logs older
than the oldest kept one are removed.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from omniload.errors import ConfigError
from omniload.state import check_state

log = logging.getLogger("omniload")
_SNAPSHOT, _DELTAS = "snapshot-", "deltas-"
_STEP, _LIVE, _NOTE = "s", "live", "note"  # the keys of a delta record
_CLOSE_S = 30.0


@dataclass(frozen=True, slots=True)
class Recovery:
    """Where a checkpoint folder says the job was: replay the planner from `state` (a snapshot
    planned at data-parallel size `dp`), with `live` added to its live changes, to `step`."""

    state: dict[str, Any]
    job: dict[str, Any]
    dp: int
    step: int
    live: list

    @property
    def replay(self) -> int:
        return self.step - self.state["step"]


class CheckpointWriter:
    """Writes on its own thread; `write` only hands a position over. A failed write is given
    to `on_error` (from the writer thread) and ends the writer.

    What waits for the disk is bounded whatever the disk does: one merged record for the log
    before the next snapshot, at most one snapshot (a newer one replaces it: the log then
    spans both), and one merged record after it."""

    def __init__(
        self,
        folder: str | os.PathLike,
        snapshot_every: int,
        keep: int,
        job: dict[str, Any],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._every, self._keep = snapshot_every, keep
        self._job = job  # spec and files, saved in snapshots so a mismatch can be explained
        self._on_error = on_error
        self._pending = _Pending()
        self._first = True  # the first position handed over is always snapshotted
        self._live_seen: list = []  # the live changes of the last position handed over
        self._busy = False
        self._closing = False
        self._failed = False
        self._wake = threading.Condition()
        self._log: BinaryIO | None = None
        self._thread = threading.Thread(target=self._run, name="omniload-checkpoint", daemon=True)
        self._thread.start()

    def write(self, state: dict[str, Any], dp: int, note: str | None = None) -> None:
        """Record that every rank consumed the steps before `state["step"]`; never blocks on the disk.
        After a failed write this does nothing: on_error has the cause, and the job is stopping."""
        if self._failed:
            return
        live = [change for change in state["live"] if change not in self._live_seen]
        self._live_seen = state["live"]
        snapshot = self._first or state["step"] % self._every == 0
        with self._wake:
            self._pending.add(
                state["step"],
                live,
                note,
                (state, dp, note if self._first else None) if snapshot else None,
                first=self._first,
            )
            self._first = False
            self._wake.notify()

    def abandon(self) -> None:
        """Write nothing more, dropping what is pending: the folder now belongs to another
        coordinator (this one lost its lease to a standby; see standby.py)."""
        self._failed = True
        with self._wake:
            self._pending = _Pending()
            self._wake.notify_all()

    def flush(self) -> None:
        """Wait until what was handed over is on disk (tests and benchmarks; close() also waits)."""
        with self._wake:
            while (self._pending or self._busy) and self._thread.is_alive():
                self._wake.wait(0.05)

    def close(self) -> None:
        """Write what is pending and stop the writer (bounded by _CLOSE_S)."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(_CLOSE_S)
        if self._thread.is_alive():
            log.warning("checkpoint: the writer did not finish in %.0fs; the folder may lag", _CLOSE_S)

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._pending and not self._closing:
                        self._wake.wait()
                    batch, self._pending = self._pending, _Pending()
                    self._busy = bool(batch)
                if not batch:
                    return  # closing, and everything is written
                self._append(batch.before)  # up to the snapshot's step, into the log before it: a
                if batch.snapshot:  # corrupt snapshot then costs only the steps after it
                    self._snapshot(*batch.snapshot)
                self._append(batch.after)
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()
        except BaseException as exc:  # the disk's (OSError) or a bug: either way the job must hear it
            self._failed = True
            self._on_error(exc)
        finally:
            if self._log:
                self._log.close()

    def _append(self, record: dict[str, Any]) -> None:
        if not record or self._log is None:
            return
        line = orjson.dumps(record)
        self._log.write(b"%08x %s\n" % (zlib.crc32(line), line))
        self._log.flush()
        os.fsync(self._log.fileno())

    def _snapshot(self, state: dict[str, Any], dp: int, note: str | None) -> None:
        step = state["step"]
        body = orjson.dumps({"state": state, "dp": dp, **self._job, **({"note": note} if note else {})})
        path = self.folder / f"{_SNAPSHOT}{step:010d}.json"
        temporary = path.with_suffix(".tmp")
        try:
            with open(temporary, "wb") as f:
                f.write(b"%08x %s" % (zlib.crc32(body), body))
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        except OSError:
            temporary.unlink(missing_ok=True)  # a full disk leaves no partial snapshot behind
            raise
        _fsync_folder(self.folder)
        if self._log:
            self._log.close()
        self._log = open(self.folder / f"{_DELTAS}{step:010d}.log", "ab")
        self._remove_old()

    def _remove_old(self) -> None:
        snapshots = sorted(self.folder.glob(f"{_SNAPSHOT}*.json"))
        if len(snapshots) <= self._keep:
            return
        for path in snapshots[: -self._keep]:
            path.unlink(missing_ok=True)
        oldest = _step_of(snapshots[-self._keep], _SNAPSHOT)
        for path in self.folder.glob(f"{_DELTAS}*.log"):
            if _step_of(path, _DELTAS) < oldest:
                path.unlink(missing_ok=True)


class _Pending:
    """What waits for the writer: the log record before the snapshot, the snapshot, the record after."""

    def __init__(self) -> None:
        self.before: dict[str, Any] = {}
        self.snapshot: tuple[dict[str, Any], int, str | None] | None = None
        self.first = False  # the pending snapshot is the job's first: kept even when the disk is behind
        self.after: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self.before or self.snapshot or self.after)

    def add(
        self,
        step: int,
        live: list,
        note: str | None,
        snapshot: tuple[dict[str, Any], int, str | None] | None,
        first: bool = False,
    ) -> None:
        record = self.after if self.snapshot else self.before
        record[_STEP] = step
        if live:
            record.setdefault(_LIVE, []).extend(live)
        if note:
            record[_NOTE] = f"{record[_NOTE]}\n{note}" if _NOTE in record else note
        if snapshot is None:
            return
        if self.first:  # the first position is always snapshotted (a job's early steps are traced and
            return  # resumed from it): a newer one while the disk is behind waits for the next turn
        if self.snapshot:  # the disk is behind: one snapshot, the newer; the log covers the steps between
            _merge(self.before, self.after)
            self.after = {}
        self.snapshot, self.first = snapshot, first


def _merge(into: dict[str, Any], record: dict[str, Any]) -> None:
    if _STEP in record:
        into[_STEP] = record[_STEP]
    if _LIVE in record:
        into.setdefault(_LIVE, []).extend(record[_LIVE])
    if _NOTE in record:
        into[_NOTE] = f"{into[_NOTE]}\n{record[_NOTE]}" if _NOTE in into else record[_NOTE]


def last_position(folder: str | os.PathLike) -> Recovery | None:
    """Where the folder says the job was, or None if it holds no snapshot yet."""
    folder = Path(folder)
    snapshots = sorted(folder.glob(f"{_SNAPSHOT}*.json"), reverse=True)
    for path in snapshots:
        loaded = _read_snapshot(path)
        if loaded is not None:
            state, dp, job = loaded
            step, live = _read_log(folder, state["step"])
            return Recovery(state, job, dp, step, live)
    if snapshots:
        raise ConfigError(
            f"checkpoint folder {str(folder)!r}: no snapshot reads cleanly; "
            "start without --resume or restore the folder from a backup"
        )
    return None


def snapshot_steps(folder: str | os.PathLike) -> list[int]:
    """The steps of the folder's snapshots, oldest first (whether they read cleanly or not)."""
    return sorted(_step_of(path, _SNAPSHOT) for path in Path(folder).glob(f"{_SNAPSHOT}*.json"))


def read_snapshot(folder: str | os.PathLike, step: int) -> tuple[dict[str, Any], int, dict[str, Any]] | None:
    """Snapshot `step` as (state, dp, {"spec", "files"}), or None if it is gone or does not read cleanly."""
    path = Path(folder) / f"{_SNAPSHOT}{step:010d}.json"
    return _read_snapshot(path) if path.exists() else None


def log_after(folder: str | os.PathLike, base: int) -> tuple[int, list]:
    """The last consumed step the log records after snapshot `base`, and the live mixture
    changes recorded since (each [step it takes effect at, weights])."""
    return _read_log(Path(folder), base)


def _read_snapshot(path: Path) -> tuple[dict[str, Any], int, dict[str, Any]] | None:
    try:
        raw = path.read_bytes()
        crc, _, body = raw.partition(b" ")
        if int(crc, 16) != zlib.crc32(body):
            raise ValueError("checksum mismatch")
        data = orjson.loads(body)
        state = check_state(data.pop("state"), str(path))
        dp = int(data.pop("dp"))
        data.pop("note", None)
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        log.warning("checkpoint: %s is unreadable (%s); trying an older snapshot", path.name, exc)
        return None
    return state, dp, data


def _read_log(folder: Path, base: int) -> tuple[int, list]:
    """The last consumed step the records after step `base` reach, and their live changes."""
    step = base
    live: list[Any] = []
    for path in sorted(folder.glob(f"{_DELTAS}*.log")):
        if _step_of(path, _DELTAS) < base:
            continue
        for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
            if not line:
                continue
            crc, _, body = line.partition(b" ")
            try:
                if int(crc, 16) != zlib.crc32(body):
                    raise ValueError("checksum mismatch")
                record = orjson.loads(body)
                consumed = int(record[_STEP])
            except (ValueError, KeyError, TypeError):
                log.warning(
                    "checkpoint: %s line %d is torn or corrupt; resuming at step %d, the last consistent one",
                    path.name,
                    number,
                    step,
                )
                return step, live
            if consumed > step:
                step = consumed
                live.extend(record.get(_LIVE, ()))
    return step, live


def _step_of(path: Path, prefix: str) -> int:
    return int(path.stem[len(prefix) :])


def _fsync_folder(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def explain_mismatch(saved: dict[str, Any], job: dict[str, Any]) -> str:
    """Name what differs between a checkpoint's spec/files and this job's."""
    lines = []
    for key in sorted(set(saved.get("spec", {})) | set(job["spec"])):
        a, b = saved.get("spec", {}).get(key), job["spec"].get(key)
        if a != b:
            lines.append(f" spec {key}: checkpoint {a!r}, job {b!r}")
    for source in sorted(set(saved.get("files", {})) | set(job["files"])):
        a = {tuple(f) for f in saved.get("files", {}).get(source, [])}
        b = {tuple(f) for f in job["files"].get(source, [])}
        for path, *_ in sorted(a - b):
            lines.append(f" source '{source}': {path} {'changed' if any(f[0] == path for f in b) else 'is gone'}")
        for path, *_ in sorted(b - a):
            if not any(f[0] == path for f in a):
                lines.append(f" source '{source}': {path} is new")
    return "\n".join(lines) or " (the checkpoint does not record what; its fingerprint differs)"
