"""How the coordinator starts a worker process: from a forkserver that has the worker loaded.

The coordinator imports this module, never worker.py: the worker's readers import pyarrow,
which costs a process some 30 MB. Workers come from a forkserver that imports worker.py once
(FORKSERVER_PRELOAD), so each worker shares those pages instead of importing it again. What
a worker is told at start is omniload/formats/lane_config.py.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection

from omniload.formats.lane_config import WorkerConfig

# This module too: a worker's process target (`run`) lives here, so the forkserver has it
# loaded before it forks, as it had when `run` sat beside the worker's configuration.
FORKSERVER_PRELOAD = ["omniload.workers.worker", "omniload.coordinator.pool.forkserver"]


def forkserver_context() -> multiprocessing.context.ForkServerContext:
    """The context workers (and the indexing child) are forked from; call before the forkserver
    starts, i.e. before any process of it is."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def run(config: WorkerConfig, inbox: Connection | None = None) -> None:
    """A worker process's entry: imports the worker there (the forkserver already has).
    `inbox`: where the coordinator sends lanes for it to take on (a re-split)."""
    from omniload.workers.worker import run_worker

    run_worker(config, inbox)
