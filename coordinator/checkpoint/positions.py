"""The job's positions on disk: where it starts from, whose data a position is of, and the
checkpoints written as the ranks consume steps.

A --resume folder's last consistent position is read before the event loop starts. A position
a rank brings, or one saved in a folder, must be of the same spec and files (the fingerprint),
unless --allow-changed-data, which says once in the checkpoint log how they differ. Every
position every rank has consumed goes to the CheckpointWriter (checkpoint/folder.py), which writes
on its own thread; a failure there stops the job through the coordinator's one failure path,
naming the folder and what to do.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from typing import Any

from omniload.coordinator.checkpoint.folder import CheckpointWriter, Recovery, explain_mismatch, last_position
from omniload.coordinator.pool.catalog import fingerprint
from omniload.errors import ConfigError, OmniloadError
from omniload.spec import Spec

log = logging.getLogger("omniload")
_DISK_FIXES = {
    errno.ENOSPC: "free space there or choose another --checkpoint-dir",
    errno.EDQUOT: "raise the disk quota there or choose another --checkpoint-dir",
    errno.EACCES: "let this user write there or choose another --checkpoint-dir",
    errno.EROFS: "the file system is read-only: choose another --checkpoint-dir",
}


class Positions:
    def __init__(self, spec: Spec, identity: dict[str, Any], fail: Callable[[str, BaseException], None]) -> None:
        """`identity`: what decides the data (pool/catalog.py's job_identity); `fail`: the
        coordinator's failure path, called on the loop once `attach` gave it one."""
        self._spec = spec
        self.identity = identity
        self.fingerprint = fingerprint(identity)
        self._fail = fail
        self._writer: CheckpointWriter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._note: str | None = None  # said once in the checkpoint log (e.g. allow_changed_data)

    def open(self) -> None:
        """Start the checkpoint writer, where the job has a folder (--checkpoint-dir or --resume)."""
        folder = self._spec.checkpoint_dir or self._spec.resume
        if folder:
            self._writer = CheckpointWriter(
                folder, self._spec.snapshot_every, self._spec.keep_snapshots, self.identity, self._failed
            )

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on a writer's failure stops the job on `loop` (before: only logged)."""
        self._loop = loop

    def read_resume_folder(self) -> Recovery | None:
        if not self._spec.resume:
            return None
        found = last_position(self._spec.resume)
        if found is None:
            log.warning("--resume %s holds no checkpoint yet; starting from the beginning", self._spec.resume)
            return None
        self.check_same_data({**found.state, "step": found.step}, f"checkpoint in {self._spec.resume}", found.job)
        return found

    def check_same_data(self, state: dict, where: str, saved_job: dict | None = None) -> None:
        if state["fingerprint"] == self.fingerprint:
            return
        what = explain_mismatch(saved_job or {}, self.identity)
        if not self._spec.allow_changed_data:
            raise ConfigError(
                f"the spec or files differ from the {where}:\n{what}\n checkpoint fingerprint: "
                f"{state['fingerprint']}\n job fingerprint: {self.fingerprint}\n"
                "resume with the same spec and files, or pass --allow-changed-data"
            )
        log.warning("the data differs from the %s (--allow-changed-data):\n%s", where, what)
        self._note = f"allow_changed_data: resumed at step {state['step']} over changed data:\n{what}"

    def consumed(self, position: dict, dp: int) -> None:
        """Every rank has consumed the steps before this position: checkpoint it."""
        if self._writer is not None:
            self._writer.write(position, dp, self._note)
            self._note = None

    def abandon(self) -> None:
        """Write nothing more (this coordinator was fenced: another one owns the folder now)."""
        if self._writer:
            self._writer.abandon()

    def close(self) -> None:
        if self._writer:
            self._writer.close()

    def _failed(self, exc: BaseException) -> None:
        """From the checkpoint writer's thread: stop the job, naming the folder and what to do."""
        folder = self._spec.checkpoint_dir or self._spec.resume
        if isinstance(exc, OSError):
            fix = _DISK_FIXES.get(exc.errno or 0, "check the folder's disk, or choose another --checkpoint-dir")
            exc = OmniloadError(f"checkpoint folder {folder}: {exc}; {fix}")
        if self._loop is None or self._loop.is_closed():  # no loop yet, or it has already ended
            log.error("checkpoint folder %s: %s", folder, exc)
            return
        self._loop.call_soon_threadsafe(self._fail, "the checkpoint writer", exc)
