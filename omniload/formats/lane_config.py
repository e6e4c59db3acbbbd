"""What a worker process is told at start (its lanes), and how the coordinator starts one.

The coordinator imports this module, never worker.py: the worker's readers import pyarrow,
which costs a process some 30 MB. Workers come from a forkserver that imports worker.py once
(FORKSERVER_PRELOAD), so each worker shares those pages instead of importing it again.
"""
from __future__ import annotations

import multiprocessing
from dataclasses import dataclass

from omniload.workers.images import ImageConfig
from omniload.workers.shards import Shard

FORKSERVER_PRELOAD = ["omniload.workers.worker"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneConfig:
    source_index: int
    source_name: str
    column: str
    tokenizer: str
    lane: int
    num_lanes: int
    ring_path: str
    shards: tuple[Shard, ...]
    seed: int
    epochs: int  # 0: forever
    interleave: int  # shards read together, their rows in turn (omniload.order)
    start_group: int  # the source's cursor when the lane starts: it produces its turns from there
    start_pos: int  # (a restart's cursor may be part-way into a turn, even another lane's)
    skip_bad_files: bool
    image_column: str | None = None  # parquet/Arrow: the column of encoded images
    images: ImageConfig | None = None  # set when the source's samples carry images


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    worker_id: int
    coordinator_pid: int
    lanes: tuple[LaneConfig, ...]


def forkserver_context() -> multiprocessing.context.BaseContext:
    """The context workers (and the indexing child) are forked from; call before the forkserver
    starts, i.e. before any process of it is."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def run(config: WorkerConfig) -> None:
    """A worker process's entry: imports the worker there (the forkserver already has)."""
    from omniload.workers.worker import run_worker

    run_worker(config)
