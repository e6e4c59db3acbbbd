"""The colocated baselines: one DataLoader per rank over every source.

`colocated_loader` does omniload's own work on every rank (the throughput and balance
benchmarks compare against it): each rank builds its own index of every source, and each of
its DataLoader workers opens every source, reads its share of shards, tokenizes, mixes by
tokens and packs into `rows x seq_len` with the same functions omniload uses (planner and
cost balancing included), so the two sides do the same work and differ only in where it
happens. It holds a whole shard's tokens at once and prefetches 4 batches per worker, so it
is several times heavier than what users write: `lean_loader` below is the least a
hand-written per-rank loader holds, and the memory benchmark compares against it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from omniload.coordinator.plan.cost import cost_function
from omniload.coordinator.plan.documents import Doc
from omniload.coordinator.plan.mixture import advance, next_source
from omniload.coordinator.plan.packer import build_batch
from omniload.coordinator.plan.step_plan import plan_step
from omniload.coordinator.plan.units import units_of
from omniload.coordinator.pool.catalog import SourceCatalog, build_catalog
from omniload.coordinator.pool.worker_pool import stop_helpers
from omniload.order import row_permutation, shard_permutation
from omniload.spec import Spec
from omniload.workers.readers import read_shard
from omniload.workers.transforms import load_transform


class ColocatedDataset(IterableDataset):
    def __init__(self, spec: Spec, rank: int, world: int) -> None:
        self.spec, self.rank, self.world = spec, rank, world
        self.catalog = build_catalog(spec)  # every rank indexes every source

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        part, parts = self.rank * workers + worker, self.world * workers
        spec = self.spec
        streams = [self._documents(src, part, parts) for src in self.catalog]
        weights, passes, live = spec.weights(), [0.0] * len(streams), [True] * len(streams)
        cost = cost_function(spec.balance, spec.cost_coeffs, [s.name for s in spec.sources])
        carry: list = []
        while True:
            need = spec.rows * spec.seq_len - sum(s.length for s in carry)
            fresh = []
            while need > 0 and (s := next_source(passes, weights, live)) is not None:
                doc = next(streams[s], None)
                if doc is None:
                    live[s] = False
                    continue
                advance(passes, s, len(doc.tokens), weights)
                fresh.extend(s for unit in units_of(doc, spec.seq_len) for s in unit)
                need -= len(doc.tokens)
            if not fresh and not carry:
                return
            plan = plan_step(carry, fresh, 1, spec.rows, spec.seq_len, cost)
            carry = plan.carry
            yield {k: torch.from_numpy(v) for k, v in build_batch(plan.rows[0], spec.seq_len).items()}

    def _documents(self, src: SourceCatalog, part: int, parts: int) -> Iterator[Doc]:
        transform = load_transform(src.tokenizer)
        n = len(src.shards)
        epochs = range(self.spec.epochs) if self.spec.epochs else itertools.count()
        # whole shards per worker; with fewer shards than workers, as colocated loaders do, each
        # worker reads a shard and keeps every k-th row of it
        stride = -(-parts // n)
        positions = range(part, n, parts) if n >= parts else [part % n]
        for epoch in epochs:
            order = shard_permutation(n, self.spec.seed, src.index, epoch)
            for position in positions:
                index = int(order[position])
                shard = src.shards[index]
                values = read_shard(shard, src.column)
                # a whole-shard shuffle (no slicing): a DataLoader worker holds its whole shard
                rows = row_permutation(shard.rows, self.spec.seed, src.index, epoch, index)
                if n < parts:
                    rows = rows[(part // n) % stride :: stride]
                for i, tokens in zip(rows, transform([values[i] for i in rows])):
                    yield Doc(src.index, shard.first_ordinal + int(i), tokens)


def rank_dataloader(dataset: IterableDataset, workers: int, prefetch: int = 2) -> DataLoader:
    """A baseline rank's DataLoader as a torchrun rank on Linux makes it (Python < 3.14): its
    workers forked. A benchmark's ranks are spawned processes, whose children would be spawned
    too and import torch again (225 MB a worker instead of 108 MB): a baseline heavier than
    what users run. Every baseline and peer loader of the benchmarks is made here."""
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=prefetch if workers else None,
        persistent_workers=False,
        multiprocessing_context="fork" if workers else None,
    )


def colocated_loader(spec: Spec, rank: int, world: int, workers: int) -> DataLoader:
    return rank_dataloader(ColocatedDataset(spec, rank, world), workers, prefetch=4)


class LeanDataset(IterableDataset):
    """The lean colocated baseline: what a user writes by hand, and what the memory benchmark
    compares against. Each DataLoader worker reads its share of every source's shards one row
    group at a time, tokenizes a document when it is taken, mixes the sources by tokens in
    proportion to their weights and packs greedily into `rows x seq_len`. No index beyond the
    files' own metadata, no planner, no cost balancing: the least a per-rank loader holds."""

    def __init__(self, spec: Spec, rank: int, world: int) -> None:
        self.spec, self.rank, self.world = spec, rank, world
        self.catalog = build_catalog(spec)  # the file footers: what opening the files costs anyway
        stop_helpers()  # build_catalog's indexing forkserver: a hand-written loader has none

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        part, parts = self.rank * workers + worker, self.world * workers
        spec = self.spec
        streams = [self._texts(src, part, parts) for src in self.catalog]
        # each document tokenized when it is taken, by its source's tokenizer (as omniload's workers do)
        transforms = [load_transform(spec.tokenizer_of(source)) for source in spec.sources]
        tokens = (transforms[s]([value])[0] for s, value in mix_texts(streams, spec.weights()))
        yield from pack_tokens(tokens, spec.rows, spec.seq_len)

    def _texts(self, src: SourceCatalog, part: int, parts: int) -> Iterator[object]:
        n = len(src.shards)
        positions = range(part, n, parts) if n >= parts else [part % n]
        stride = -(-parts // n)
        for epoch in range(self.spec.epochs) if self.spec.epochs else itertools.count():
            order = shard_permutation(n, self.spec.seed, src.index, epoch)
            for position in positions:
                values = read_shard(src.shards[int(order[position])], src.column)
                yield from (values[(part // n) % stride :: stride] if n < parts else values)


def mix_texts(streams: list[Iterator[object]], weights: list[float]) -> Iterator[tuple[int, object]]:
    """(stream, value) pairs, each next from the stream furthest behind its share of bytes."""
    taken = [0.0] * len(streams)
    live = list(range(len(streams)))
    while live:
        s = min(live, key=lambda i: (taken[i] / weights[i], i))
        value = next(streams[s], None)
        if value is None:
            live.remove(s)
            continue
        taken[s] += len(value) if isinstance(value, str) else 4 * len(value)
        yield s, value


def pack_tokens(documents: Iterator[np.ndarray], rows: int, seq_len: int) -> Iterator[dict[str, torch.Tensor]]:
    """Cut the stream of tokenized documents into `rows x seq_len` batches."""
    need = rows * seq_len
    held: list[np.ndarray] = []
    count = 0
    for tokens in documents:
        held.append(tokens.astype(np.int32, copy=False))
        count += len(tokens)
        while count >= need:
            flat = np.concatenate(held)
            batch, rest = flat[:need], flat[need:]
            held, count = [rest], len(rest)
            yield {"input_ids": torch.from_numpy(batch.reshape(rows, seq_len).copy())}


def lean_loader(spec: Spec, rank: int, world: int, workers: int) -> DataLoader:
    return rank_dataloader(LeanDataset(spec, rank, world), workers)
