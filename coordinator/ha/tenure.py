"""The lease this coordinator serves under, and the fence when it loses it.

A primary with a checkpoint folder takes the first lease once it listens (the epoch after the
folder's highest); a standby takes the next epoch when it takes over (ha/roles.py). A
LeaseKeeper (below) renews it on a thread (a disk write never waits on the event loop); once
it may no longer be held, this coordinator is fenced: it stops serving and writing at once,
tells every rank (which moves to the new primary) and exits with FENCED_EXIT. Without a
checkpoint folder there is no lease (epoch 0).

UNHELD -> HELD (`take_first`, `hold`) -> FENCED (lost) | RELEASED (`release`: the job's end
recorded, so that standbys leave).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from omniload.coordinator.ha import lease as leases
from omniload.coordinator.ha.lease import job_digest
from omniload.job import FENCED_EXIT  # the launcher replaces a coordinator that exits with it

log = logging.getLogger("omniload")
_ACQUIRE_TRIES = 20


class TenureJob(Protocol):
    """What the tenure needs of its job: the parts of server.py's Coordinator it uses, and no more."""

    token: bytes
    loop: asyncio.AbstractEventLoop | None
    should_exit: asyncio.Event

    def halt(self, code: int, error: dict[str, Any], abandon_checkpoints: bool = False) -> None: ...


class Tenure:
    def __init__(self, job: TenureJob) -> None:
        self._job = job
        self.epoch = 0  # the lease epoch this coordinator serves under (0: no checkpoint folder, no lease)
        self._keeper: LeaseKeeper | None = None
        self.fenced: str | None = None  # why this coordinator lost its lease, once it has

    @property
    def held(self) -> bool:
        return self._keeper is not None

    async def take_first(self, folder: str, addr: str) -> None:
        """The first primary's lease in its checkpoint folder (a disk write: on a thread)."""
        job = job_digest(self._job.token.decode())
        self.epoch = await asyncio.get_running_loop().run_in_executor(None, take_first_lease, folder, job, addr)
        self._keeper = LeaseKeeper(folder, self.epoch, self._on_fenced)

    def hold(self, folder: str, epoch: int) -> None:
        """A standby that took over holds the lease of `epoch` now: renew it."""
        self.epoch = epoch
        self._keeper = LeaseKeeper(folder, epoch, self._on_fenced)

    def still_held(self) -> bool:
        """False (and fenced now) if this coordinator lost its lease before it served."""
        if self.fenced:
            self._fence(self.fenced)
            return False
        return True

    def release(self, code: int) -> None:
        """Stop renewing; once the folder holds the last position, record the job's end with
        `code` (unless fenced), so that the standbys leave."""
        if self._keeper:
            self._keeper.stop(code if self.fenced is None else None)

    def _on_fenced(self, reason: str) -> None:
        """From the lease thread: this primary must stop serving."""
        self.fenced = reason
        loop = self._job.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._fence, reason)
            except RuntimeError:
                pass  # the loop closed meanwhile: the job is ending anyway

    def _fence(self, reason: str) -> None:
        """Lost the lease: stop serving and writing at once; the ranks move to the new primary."""
        if self._job.should_exit.is_set():
            return
        log.error("this coordinator (epoch %d) stops serving: %s", self.epoch, reason)
        self._job.halt(
            FENCED_EXIT,
            {"message": f"coordinator of epoch {self.epoch} fenced: {reason}", "fenced": True},
            abandon_checkpoints=True,
        )


def take_first_lease(folder: str, job: str, addr: str) -> int:
    """The primary's lease at startup: the epoch after the folder's highest."""
    for _ in range(_ACQUIRE_TRIES):
        epoch = leases.highest_epoch(folder) + 1
        if leases.acquire(folder, epoch, addr, job):
            return epoch
    raise RuntimeError(f"could not take a lease in {folder}: other coordinators keep taking one")


class LeaseKeeper:
    """Renews the primary's lease every _RENEW_S on its own thread; `on_fenced(reason)` once."""

    def __init__(self, folder: str, epoch: int, on_fenced: Callable[[str], None]) -> None:
        self.folder, self.epoch = folder, epoch
        self._on_fenced = on_fenced
        self._stop = threading.Event()
        self.fenced: str | None = None
        self._thread = threading.Thread(target=self._run, name="omniload-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        renewed = time.monotonic()
        leases.remove_older(self.folder, self.epoch)
        while not self._stop.wait(leases.RENEW_S):
            try:
                leases.renew(self.folder, self.epoch)
                renewed = time.monotonic()
            except OSError as exc:
                log.warning("could not renew the lease in %s: %s", self.folder, exc)
            try:
                highest = leases.highest_epoch(self.folder)
            except OSError:
                highest = self.epoch  # the folder is unreachable: the renewal's age decides
            reason = leases.must_fence(self.epoch, highest, renewed, time.monotonic())
            if reason is not None:
                self.fenced = reason
                self._on_fenced(reason)
                return

    def stop(self, code: int | None) -> None:
        """Stop renewing; with `code`, record that this primary ended the job (its standbys leave)."""
        self._stop.set()
        self._thread.join(leases.RENEW_S * 4)
        if code is not None and self.fenced is None:
            try:
                leases.mark_ended(self.folder, self.epoch, code)
            except OSError as exc:
                log.warning("could not record the job's end in %s: %s", self.folder, exc)
