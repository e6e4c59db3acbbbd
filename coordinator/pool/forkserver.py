"""How the coordinator starts a worker process: from a forkserver that has the worker loaded.

The coordinator imports this module, never worker.py: the worker's readers import pyarrow,
which costs a process some 30 MB. Workers come from a forkserver that imports worker.py once
(FORKSERVER_PRELOAD), so each worker shares those pages instead of importing it again. What
a worker is told at start is omniload/formats/lane_config.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterable
from multiprocessing.connection import Connection

from omniload.formats.lane_config import PRELOADED_TOKENIZERS_ENV, WorkerConfig

# This module too: a worker's process target (`run`) lives here, so the forkserver has it
# loaded before it forks, as it had when `run` sat beside the worker's configuration.
# tokenizer_preload loads the tokenizers share_tokenizers names, once for every worker.
# numpy.random: numpy imports it on first use, which is every worker's first shard (its row
# order); each worker would import it again, into memory of its own.
FORKSERVER_PRELOAD = [
    "omniload.workers.worker",
    "numpy.random",
    "omniload.coordinator.pool.forkserver",
    "omniload.workers.tokenizer_preload",
]


def share_tokenizers(names: Iterable[str]) -> None:
    """Have the forkserver load the tokenizer.json files among `names` before it forks any
    worker, so its workers share one copy of each (workers/tokenizer_preload.py); no names:
    each worker loads its own. Call before the forkserver starts (build_catalog starts it):
    a started one keeps what it has. Worth it where more than one worker may run, as the
    forkserver then holds each tokenizer too."""
    os.environ[PRELOADED_TOKENIZERS_ENV] = json.dumps(sorted(set(names)))


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
