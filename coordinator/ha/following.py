"""A hot standby's wait for its turn: it follows the primary's lease and the checkpoint folder.

A standby coordinator (`omniload launch --standby N`, `omniload serve --as-standby`) builds its
catalog, announces its address and `follow`s the lease in the shared checkpoint folder
(lease.py) before any worker, thread or event loop exists. Once the primary has written a
snapshot, the standby restores it like --resume, starts its workers, and plans along without
building batches as the delta log grows (ha/roles.py, `Standby.follow`): it is hot. When the
primary's process is gone (same host) or its lease expires, it takes the next epoch, plans
the few steps logged since its last look and listens; the ranks reconnect to it with their
own positions. A primary that dies before its first snapshot is taken over cold, from the
job's start.

Why the folder and not a replication stream from the primary: the delta log already holds
every fact a replay needs, fsynced, and a standby on another host reads it from the shared
folder without a second protocol, a connection the primary must serve, or a way for a slow
standby to hold the primary back. Exactness does not depend on how fresh the standby's copy
is: the folder's step is a lower bound of every rank's own position, and planning forward
from it is deterministic. The lease lives beside the log, so the folder the job's exactness
depends on is also the one arbiter of who is primary.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from omniload.coordinator.checkpoint.folder import snapshot_steps
from omniload.coordinator.ha import lease as leases

log = logging.getLogger("omniload")
_POLL_S = 0.05  # how often a standby looks at the lease
_NO_PRIMARY_WARN_S = 60.0  # a standby that has seen no lease of its job this long says so (once)


@dataclass(frozen=True, slots=True)
class Turn:
    """How a standby's wait ended: it holds `epoch` (code None), the job ended with `code`, or
    (`hot`) the folder holds a snapshot to follow from while the primary still serves."""

    epoch: int = 0
    code: int | None = None
    hot: bool = False


class Follower:
    """A standby's view of the lease, one look at a time (`look`: a few small file reads)."""

    def __init__(self, folder: str, job: str, addr: str) -> None:
        self.folder, self.job, self.addr = folder, job, addr
        self._watch: leases.Watch | None = None
        self._following: int | None = None
        self._started, self._warned = time.monotonic(), False

    def look(self) -> Turn | None:
        """Turn(epoch) once this standby took over, Turn(code) once the job ended, else None."""
        lease = leases.read_lease(self.folder)
        alive = leases.holder_alive(lease) if lease is not None else None
        ended = leases.ended_code(self.folder, lease.epoch) if lease is not None else None
        decision, self._watch = leases.judge(
            self._watch, lease, time.monotonic(), job=self.job, holder_alive=alive, ended=ended
        )
        if decision == leases.WAIT and not self._warned and time.monotonic() - self._started > _NO_PRIMARY_WARN_S:
            self._warned = True
            log.warning(
                "standby at %s: no primary of this job holds a lease in %s yet; is it running with the "
                "same --checkpoint-dir and OMNILOAD_TOKEN?",
                self.addr,
                self.folder,
            )
        if lease is None:  # judge waits while there is no lease
            return None
        if decision == leases.ENDED:
            log.info("standby: the primary of epoch %d ended the job (code %d); exiting", lease.epoch, ended)
            return Turn(code=ended)
        if decision == leases.FOLLOW and self._following != lease.epoch:
            self._following = lease.epoch
            log.info(
                "standby at %s: following the primary of epoch %d (pid %d on %s, %s)",
                self.addr,
                lease.epoch,
                lease.pid,
                lease.host,
                lease.addr,
            )
        if decision == leases.TAKE_OVER:
            why = "its process is gone" if alive is False else f"its lease was not renewed for {leases.LEASE_S:g}s"
            if leases.acquire(self.folder, lease.epoch + 1, self.addr, self.job):
                log.warning(
                    "standby at %s takes over as the primary of epoch %d: the primary of epoch %d (pid %d on %s) %s",
                    self.addr,
                    lease.epoch + 1,
                    lease.epoch,
                    lease.pid,
                    lease.host,
                    why,
                )
                return Turn(epoch=lease.epoch + 1)
            self._watch = None  # another standby was faster: follow it
        return None

    def following(self) -> bool:
        """The primary of this job holds the lease (and this standby watches it)."""
        return self._following is not None


def follow(follower: Follower, parent: int | None, until_snapshot: bool = False) -> Turn:
    """Wait (bounded by the job itself: it returns when the primary ends the job or is gone) until
    this standby holds the lease, or (`until_snapshot`) the primary has written a snapshot to
    follow hot from. Call before any thread or event loop starts. `parent`: exit with that
    process (the launcher), when given."""
    while True:
        if parent is not None and os.getppid() != parent:
            log.error("the launching process is gone; the standby exits")
            return Turn(code=1)
        turn = follower.look()
        if turn is not None:
            return turn
        if until_snapshot and follower.following() and snapshot_steps(follower.folder):
            return Turn(hot=True)
        time.sleep(_POLL_S)


def warm_forkserver() -> None:
    """Start now the forkserver the worker pool forks from (pool/worker_pool.py), with its preload: a
    takeover then forks workers at once instead of first starting Python and importing pyarrow
    (about 0.8 s). Call before any thread starts; the server leaves when this process does."""
    from multiprocessing import forkserver

    from omniload.coordinator.pool.forkserver import forkserver_context

    forkserver_context()
    forkserver.ensure_running()
