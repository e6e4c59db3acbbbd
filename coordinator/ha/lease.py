"""Who is the primary: a lease with an epoch in the checkpoint folder, and the rules that read it.

    lease-<epoch>.json   created (O_EXCL) by the coordinator that became primary at <epoch>:
                         {"epoch", "pid", "host", "addr", "job"}; its mtime is renewed every
                         RENEW_S while that coordinator serves
    ended-<epoch>.json   {"code"}: the primary of <epoch> ended the job (done, failed or
                         stopped): its standbys leave instead of taking over

Only one coordinator can create `lease-<e+1>`, so two standbys never both take over. The
primary stops serving (fences itself) as soon as it sees a higher epoch or has not renewed
its lease for FENCE_S; a standby takes over only after seeing no renewal for LEASE_S
(> FENCE_S) on its own clock, or at once when the holder ran on its host and its process is
gone. Both clocks are each side's own monotonic clock, so wall-clock skew between hosts does
not matter; a rank also refuses a coordinator whose epoch is below one it has seen.

The decisions (`judge`, `must_fence`) are pure; the file functions are the only I/O.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import orjson

_LEASE, _ENDED = "lease-", "ended-"
RENEW_S = 0.25  # how often the primary renews its lease (and looks for a higher epoch)
FENCE_S = 1.5  # the primary stops serving when its last renewal is this old
LEASE_S = 3.0  # a standby takes over a lease not renewed for this long (> FENCE_S + a renewal)

WAIT, FOLLOW, TAKE_OVER, ENDED = "wait", "follow", "take over", "ended"


@dataclass(frozen=True, slots=True)
class Lease:
    """The newest lease file: who holds it and its renewal stamp (the file's mtime_ns)."""

    epoch: int
    pid: int
    host: str
    addr: str
    job: str
    stamp: int


@dataclass(frozen=True, slots=True)
class Watch:
    """What a standby saw last: the lease's epoch and stamp, and when (its monotonic clock) they changed."""

    epoch: int
    stamp: int
    changed_at: float


def job_digest(token: str) -> str:
    """Names the job in its leases without writing its token to disk."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def judge(
    watch: Watch | None,
    lease: Lease | None,
    now: float,
    *,
    job: str,
    holder_alive: bool | None,
    ended: int | None,
    lease_s: float = LEASE_S,
) -> tuple[str, Watch | None]:
    """A standby's decision and what it keeps watching: WAIT (no lease of this job yet), FOLLOW,
    TAKE_OVER (the holder is gone or its lease expired) or ENDED (its primary ended the job).
    `holder_alive`: False only when the holder ran on this host and its process is gone."""
    if lease is None or lease.job != job:
        return WAIT, None
    if ended is not None:
        return ENDED, watch
    if holder_alive is False:
        return TAKE_OVER, watch
    if watch is None or (watch.epoch, watch.stamp) != (lease.epoch, lease.stamp):
        return FOLLOW, Watch(lease.epoch, lease.stamp, now)
    if now - watch.changed_at >= lease_s:
        return TAKE_OVER, watch
    return FOLLOW, watch


def must_fence(epoch: int, highest: int, renewed_at: float, now: float, fence_s: float = FENCE_S) -> str | None:
    """Why the primary of `epoch` must stop serving now, or None."""
    if highest > epoch:
        return f"a standby took over as the primary of epoch {highest} (this one held epoch {epoch})"
    if now - renewed_at > fence_s:
        return (
            f"could not renew its lease for {now - renewed_at:.1f}s (the checkpoint folder is unreachable "
            "or the host stalled); a standby may take over"
        )
    return None


# -- the files --------------------------------------------------------------------------------
def lease_path(folder: str | os.PathLike, epoch: int) -> Path:
    return Path(folder) / f"{_LEASE}{epoch:010d}.json"


def highest_epoch(folder: str | os.PathLike) -> int:
    """The highest epoch leased in the folder (0: none yet)."""
    epochs = [
        int(p.stem[len(_LEASE) :]) for p in Path(folder).glob(f"{_LEASE}*.json") if p.stem[len(_LEASE) :].isdigit()
    ]
    return max(epochs, default=0)


def read_lease(folder: str | os.PathLike) -> Lease | None:
    """The newest lease, or None if there is none (or it is being written: its holder is then alive)."""
    epoch = highest_epoch(folder)
    if epoch == 0:
        return None
    path = lease_path(folder, epoch)
    try:
        stamp = path.stat().st_mtime_ns
        data = orjson.loads(path.read_bytes())
        return Lease(epoch, int(data["pid"]), str(data["host"]), str(data["addr"]), str(data["job"]), stamp)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def acquire(folder: str | os.PathLike, epoch: int, addr: str, job: str) -> bool:
    """Become the primary of `epoch`; False if another coordinator already did."""
    path = lease_path(folder, epoch)
    try:
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    body = orjson.dumps({"epoch": epoch, "pid": os.getpid(), "host": socket.gethostname(), "addr": addr, "job": job})
    try:
        os.write(handle, body)
        os.fsync(handle)
    finally:
        os.close(handle)
    return True


def renew(folder: str | os.PathLike, epoch: int) -> None:
    os.utime(lease_path(folder, epoch))


def mark_ended(folder: str | os.PathLike, epoch: int, code: int) -> None:
    Path(folder, f"{_ENDED}{epoch:010d}.json").write_bytes(orjson.dumps({"code": code}))


def ended_code(folder: str | os.PathLike, epoch: int) -> int | None:
    """The exit code the primary of `epoch` ended the job with, or None if it has not."""
    try:
        return int(orjson.loads(Path(folder, f"{_ENDED}{epoch:010d}.json").read_bytes())["code"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_older(folder: str | os.PathLike, epoch: int) -> None:
    """Forget the leases and ends of epochs before `epoch`: only the newest decides anything."""
    for prefix in (_LEASE, _ENDED):
        for path in Path(folder).glob(f"{prefix}*.json"):
            number = path.stem[len(prefix) :]
            if number.isdigit() and int(number) < epoch:
                path.unlink(missing_ok=True)


def holder_alive(lease: Lease) -> bool | None:
    """False when the holder ran on this host and its process is gone (or a zombie); None
    when that cannot be told from here (another host): then only the lease's expiry counts."""
    if lease.host != socket.gethostname():
        return None
    import psutil

    try:
        return psutil.Process(lease.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
