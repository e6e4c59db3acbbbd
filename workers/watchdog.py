"""A process forked from the workers' forkserver ends when the coordinator that asked for it
does: a worker, and the indexing child (coordinator/pool/catalog.py).

Their parent is the forkserver, which by design outlives the coordinator while any of them
lives, so each watches the coordinator itself. No pyarrow here: the coordinator imports this
module to hand the indexing child its first task."""

from __future__ import annotations

import os
import select
import threading
import time


def exit_with(pid: int) -> None:
    """End this process as soon as process `pid` is gone, whatever it is doing then."""

    def watch() -> None:
        try:
            pidfd = os.pidfd_open(pid)
            select.select([pidfd], [], [])  # readable when the process exits
        except (AttributeError, OSError):  # no pidfd (old kernel, not Linux): poll
            while _alive(pid):
                time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="omniload-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
