"""The checkpoint folder: full snapshots every so often, a per-step delta log in between.

    snapshot-<step>.json   the whole position after <step>, plus the spec and file list
    deltas-<step>.log      one line per later step: "<crc32 hex> <json delta>"

A delta holds only what changed: the cursors and windows that moved, the passes and weights, the carry
segments added and removed, new live changes. Snapshots are written atomically (temporary
file, fsync, rename, fsync of the folder). Restore takes the newest snapshot that reads
cleanly and applies deltas while each is intact and continues the step before it, so a torn
last record or a corrupt snapshot costs steps, never correctness, and is reported.
"""
from __future__ import annotations

import logging
import os
import zlib
from pathlib import Path
from typing import Any

import orjson

from omniload.errors import ConfigError
from omniload.state import STATE_VERSION, check_state

log = logging.getLogger("omniload")
_SNAPSHOT, _DELTAS = "snapshot-", "deltas-"


class CheckpointWriter:
    def __init__(self, folder: str | os.PathLike, snapshot_every: int, job: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._every = snapshot_every
        self._job = job  # spec and files, saved in snapshots so a mismatch can be explained
        self._last: dict[str, Any] | None = None
        self._log = None

    def write(self, state: dict[str, Any], note: str | None = None) -> None:
        """Record the position after step `state["step"] - 1` was consumed by every rank."""
        if self._last is not None:  # also at a snapshot, so a corrupt snapshot does not cut the chain
            delta = diff(self._last, state)
            if note:
                delta["note"] = note
            line = orjson.dumps(delta)
            self._log.write(b"%08x %s\n" % (zlib.crc32(line), line))
            self._log.flush()
            os.fsync(self._log.fileno())
        if self._last is None or state["step"] % self._every == 0:
            self._snapshot(state, note if self._last is None else None)
        self._last = state

    def _snapshot(self, state: dict[str, Any], note: str | None) -> None:
        step = state["step"]
        body = orjson.dumps({"state": state, **self._job, **({"note": note} if note else {})})
        path = self.folder / f"{_SNAPSHOT}{step:010d}.json"
        temporary = path.with_suffix(".tmp")
        with open(temporary, "wb") as f:
            f.write(b"%08x %s" % (zlib.crc32(body), body))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        folder = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
        if self._log:
            self._log.close()
        self._log = open(self.folder / f"{_DELTAS}{step:010d}.log", "ab")

    def close(self) -> None:
        if self._log:
            self._log.close()


def diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    old_carry = {tuple(c) for c in old["carry"]}
    new_carry = {tuple(c) for c in new["carry"]}
    return {
        "step": new["step"],
        "cursors": {s: c for s, c in new["cursors"].items() if old["cursors"].get(s) != c},
        "windows": {s: w for s, w in new["windows"].items() if old["windows"].get(s) != w},
        "passes": new["passes"], "weights": new["weights"], "tokens": new["tokens"], "dropped": new["dropped"],
        "carry_out": [i for i, c in enumerate(old["carry"]) if tuple(c) not in new_carry],
        "carry_in": [c for c in new["carry"] if tuple(c) not in old_carry],
        "live_in": new["live"][len(old["live"]):],
    }


def apply(state: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    gone = set(delta["carry_out"])
    carry = [c for i, c in enumerate(state["carry"]) if i not in gone] + delta["carry_in"]
    return {**state, "step": delta["step"], "cursors": {**state["cursors"], **delta["cursors"]},
            "windows": {**state["windows"], **delta["windows"]},
            "passes": delta["passes"], "weights": delta["weights"], "tokens": delta["tokens"],
            "dropped": delta["dropped"], "carry": carry, "live": state["live"] + delta["live_in"]}


def last_position(folder: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(state, job) at the last consistent step in `folder`, or None if it holds none."""
    folder = Path(folder)
    snapshots = sorted(folder.glob(f"{_SNAPSHOT}*.json"), reverse=True)
    for path in snapshots:
        loaded = _read_snapshot(path)
        if loaded is None:
            continue
        state, job = loaded
        state = _replay(folder, state)
        return state, job
    if snapshots:
        raise ConfigError(f"checkpoint folder {str(folder)!r}: no snapshot reads cleanly; "
                          "start without --resume or restore the folder from a backup")
    return None


def _read_snapshot(path: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    try:
        raw = path.read_bytes()
        crc, _, body = raw.partition(b" ")
        if int(crc, 16) != zlib.crc32(body):
            raise ValueError("checksum mismatch")
        data = orjson.loads(body)
        state = check_state(data.pop("state"), str(path))
        data.pop("note", None)
    except (OSError, ValueError, KeyError, ConfigError) as exc:
        log.warning("checkpoint: %s is unreadable (%s); trying an older snapshot", path.name, exc)
        return None
    return state, data


def _replay(folder: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Apply every intact, continuous delta after the snapshot's step."""
    base = state["step"]
    for path in sorted(folder.glob(f"{_DELTAS}*.log")):
        if int(path.stem[len(_DELTAS):]) < base:
            continue
        for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
            if not line:
                continue
            crc, _, body = line.partition(b" ")
            try:
                if int(crc, 16) != zlib.crc32(body):
                    raise ValueError("checksum mismatch")
                delta = orjson.loads(body)
            except ValueError:
                log.warning("checkpoint: %s line %d is torn or corrupt; resuming at step %d, the last consistent one",
                            path.name, number, state["step"])
                return state
            if delta["step"] <= state["step"]:
                continue
            if delta["step"] != state["step"] + 1:
                log.warning("checkpoint: %s jumps from step %d to %d; resuming at step %d",
                            path.name, state["step"], delta["step"], state["step"])
                return state
            state = apply(state, delta)
    return state


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


__all__ = ["CheckpointWriter", "STATE_VERSION", "apply", "diff", "explain_mismatch", "last_position"]
