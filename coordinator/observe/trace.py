"""Which documents trained a step: recomputed from a checkpoint folder, never stored.

Every step is a pure function of the position, the data-parallel size and the live mixture
changes (docs/architecture.md, Invariants: deterministic), so `trace_step` does offline what a
resuming coordinator does (coordinator/planning.py's `replay`): rebuild the job from the spec
saved in the snapshot (refused if the files changed), restore the newest snapshot at or before
the step, replay the planner to it without building batches, and plan the step itself with
its batches. A segment's sample_id names its document (omniload.order: source, ordinal,
chunk); the catalog's shards name the file and the row. Where the folder holds the snapshot right after the step, the
position after the traced step must equal it, or the trace is refused: that catches a step
planned by a job that resumed there at another size.

Traceable: from the oldest snapshot kept (and step 0 while the job's first snapshot, of step
1, is kept) to the last step every rank consumed. The workers run as in a job (a small pool:
the data do not depend on it); they are stopped and their rings unlinked whatever happens.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from omniload.coordinator.checkpoint.folder import (
    explain_mismatch,
    last_position,
    log_after,
    read_snapshot,
    snapshot_steps,
)
from omniload.coordinator.plan.requests import Cancelled
from omniload.coordinator.plan.stepper import Step, Stepper
from omniload.coordinator.pool.catalog import SourceCatalog, build_catalog, fingerprint, job_identity
from omniload.coordinator.pool.intake import SourceIntake
from omniload.coordinator.pool.lane_split import assign_lanes
from omniload.coordinator.pool.worker_pool import WorkerPool, describe_exit, stop_helpers
from omniload.coordinator.spill import Spill
from omniload.errors import ConfigError, OmniloadError
from omniload.formats.shards import part_name
from omniload.layout import Layout
from omniload.order import split_sample_id
from omniload.spec import Spec

_WATCH_S = 0.1  # how often the trace looks for a dead worker


@dataclass(frozen=True, slots=True)
class Traced:
    """One segment of a rank's batch and the document it came from."""

    sample_id: int  # as the rank received it
    source: str
    file: str
    format: str  # parquet | jsonl | arrow | arrow-stream
    part: int  # the shard's start: parquet row group, Arrow record batch, JSON lines' first row
    row: int  # the document's row in its file, 0-based (JSON lines: among its non-empty lines)
    chunk: int  # which --seq-len chunk of the document's tokens (0: its start)
    tokens: int
    batch_row: int  # where the segment lies in the rank's batch: row and offset in it
    offset: int


@dataclass(frozen=True, slots=True)
class RankTrace:
    dp_rank: int
    ranks: list[int]  # the global ranks that receive this batch (cp ranks: their slices of it)
    segments: list[Traced]
    padding: int  # padding tokens (source -1)


@dataclass(frozen=True, slots=True)
class StepTrace:
    step: int
    snapshot: int | None  # the snapshot replayed from; None: the job's start
    replayed: int
    layout: dict[str, Any]  # world, dp, tp, cp, pp, order
    ranks: list[RankTrace]
    notes: list[str]


def trace_step(
    folder: str | os.PathLike, step: int, rank: int | None = None, dp_rank: int | None = None, workers: int = 2
) -> StepTrace:
    """Trace `step` (0-based, as loader.step) on every data-parallel rank, or on the one of
    global `rank` or of `dp_rank`. Raises ConfigError naming what stops it (range, changed files)."""
    folder = Path(folder)
    base, (state, dp, job) = _snapshot_for(folder, step)
    spec = _saved_spec(job, folder, workers)
    layout = Layout(world=dp * spec.model_parallel, tp=spec.tp, pp=spec.pp, cp=spec.cp, order=spec.rank_order)
    wanted, notes = _wanted_ranks(layout, spec, rank, dp_rank)
    try:
        catalog = build_catalog(spec)
    finally:
        stop_helpers()  # the indexing child's forkserver: the replay's pool starts its own
    _check_same_data(folder, state, job, job_identity(spec, catalog))
    live = [
        change for change in state["live"] + log_after(folder, base if base is not None else 0)[1] if change[0] <= step
    ]
    planned, after = _plan(spec, catalog, dp, None if base is None else state, live, step - (base or 0), workers)
    _confirm(folder, step + 1, after, base is None)
    shards = _Shards(catalog)
    ranks = [_rank_trace(d, planned.batches[d], shards, layout, spec) for d in wanted]
    return StepTrace(
        step=step,
        snapshot=base,
        replayed=step - (base or 0),
        layout={"world": layout.world, "dp": dp, "tp": spec.tp, "cp": spec.cp, "pp": spec.pp, "order": spec.rank_order},
        ranks=ranks,
        notes=notes,
    )


def trace_to_dict(trace: StepTrace) -> dict[str, Any]:
    return dataclasses.asdict(trace)


# -- which snapshot, which spec --------------------------------------------------------------
def _snapshot_for(folder: Path, step: int) -> tuple[int | None, tuple[dict, int, dict]]:
    """The newest snapshot at or before `step` that reads cleanly (None: step 0 from the job's
    start, checked later against snapshot 1); raises naming the steps that can be traced."""
    kept = snapshot_steps(folder) if folder.is_dir() else []
    if not kept:
        raise ConfigError(f"{folder} holds no snapshot: give the --checkpoint-dir of a job")
    last = last_position(folder)
    if last is None:
        raise ConfigError(f"{folder} holds no snapshot that reads cleanly: give the --checkpoint-dir of a job")
    consumed = last.step
    if step < consumed:
        for base in reversed([s for s in kept if s <= step]):
            loaded = read_snapshot(folder, base)
            if loaded is not None:
                return base, loaded
        if step == 0 and kept[0] == 1 and (loaded := read_snapshot(folder, 1)) is not None:
            return None, loaded
    first = 0 if kept[0] == 1 else kept[0]
    where = (
        f"every rank has consumed steps up to {consumed - 1} by the folder's log (it lags the ranks by at "
        "most one write)"
        if step >= consumed
        else f"the snapshots kept are of steps {', '.join(map(str, kept))}; the job keeps the newest "
        "--keep-snapshots and removes older ones with their logs: run it with a larger --keep-snapshots "
        "to trace further back (the folder spans about keep-snapshots x snapshot-every steps)"
    )
    span = f"steps {first} to {consumed - 1} can be traced" if consumed > first else "no step can be traced yet"
    raise ConfigError(f"step {step} cannot be traced from {folder}: {span}; {where}")


def _saved_spec(job: dict[str, Any], folder: Path, workers: int) -> Spec:
    if "spec" not in job:
        raise ConfigError(f"the snapshots in {folder} do not record the job's spec; this omniload cannot trace them")
    return Spec.from_dict({**job["spec"], "workers": workers}, f"the spec saved in {folder}")


def _check_same_data(folder: Path, state: dict, job: dict, identity: dict) -> None:
    now = fingerprint(identity)
    if now != state["fingerprint"]:
        raise ConfigError(
            f"the files differ from those the job in {folder} read, so its steps cannot be "
            f"recomputed:\n{explain_mismatch(job, identity)}\n checkpoint fingerprint: "
            f"{state['fingerprint']}\n files now: {now}\nrestore the job's files to trace its steps"
        )


def _wanted_ranks(layout: Layout, spec: Spec, rank: int | None, dp_rank: int | None) -> tuple[list[int], list[str]]:
    notes = []
    if spec.cp > 1:
        notes.append(
            f"cp {spec.cp}: each rank of a replica receives its slice of every row; sample_id and "
            "cu_seqlens, and this trace, describe the full rows"
        )
    if rank is not None:
        coords = layout.coords(rank)  # raises for a rank outside the world
        notes.append(
            f"rank {rank} is dp rank {coords['dp']} (tp {coords['tp']}, cp {coords['cp']}, pp "
            f"{coords['pp']}) in a world of {layout.world}"
        )
        if not layout.needs_data(rank, spec.pp_data):
            notes.append(
                f"rank {rank} receives no batch itself (pipeline stage {coords['pp']}, pp-data "
                f"{spec.pp_data}); its replica's batch follows"
            )
        return [coords["dp"]], notes
    if dp_rank is not None:
        if not 0 <= dp_rank < layout.dp:
            raise ConfigError(f"dp rank {dp_rank} is outside the data-parallel size {layout.dp} of that step")
        return [dp_rank], notes
    return list(range(layout.dp)), notes


# -- planning, offline -------------------------------------------------------------------------
def _plan(
    spec: Spec, catalog: list[SourceCatalog], dp: int, state: dict | None, live: list, replay: int, workers: int
) -> tuple[Step, dict]:
    """The step `replay` steps after `state` (None: the job's start), and the position after it."""
    plan = assign_lanes(spec.weights(), max(1, min(workers, len(catalog))))
    pool = WorkerPool(spec, catalog, plan, os.urandom(4).hex(), os.getpid())
    watch = None
    spill = Spill(spec.shuffle_dir)  # a replay holds the job's spreads, as the coordinator does
    try:
        intakes = [SourceIntake(src, pool.source_rings(src.index), spec.seed, spec.shard_interleave) for src in catalog]
        stepper = Stepper(spec, intakes, live_changes=[(at, weights) for at, weights in live], store=spill)
        if state is not None:
            stepper.load_state_dict({**state, "live": live})
        for worker_id in range(len(plan)):
            pool.start(worker_id, lambda source, _lane: intakes[source].cursor)
        watch = _Watch(pool, stepper.cancel)
        stepper.dp = dp
        try:
            for _ in range(replay):
                _next_step(stepper, build=False)
            planned = _next_step(stepper, build=True)
        except Cancelled:
            raise OmniloadError(watch.failure) from None
        return planned, stepper.state_dict(state["fingerprint"] if state else "")
    finally:
        if watch is not None:
            watch.stop()
        pool.stop()
        spill.close()


def _next_step(stepper: Stepper, build: bool) -> Step:
    planned = stepper.next_step(build=build)
    if planned is None:
        raise OmniloadError(
            f"the data ended at step {stepper.step} in the replay, before the folder's last step: "
            "the folder and the data disagree (a bug in omniload: please report it)"
        )
    return planned


class _Watch:
    """Cancels the stepper's wait when a worker dies: a job's supervisor would restart it, a
    trace stops and names it (never an endless wait)."""

    def __init__(self, pool: WorkerPool, cancel: threading.Event) -> None:
        self.failure = ""
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pool, cancel), name="omniload-trace-watch", daemon=True)
        self._thread.start()

    def _run(self, pool: WorkerPool, cancel: threading.Event) -> None:
        while not self._stopped.wait(_WATCH_S):
            for worker_id, worker in enumerate(pool.workers):
                code = worker.exitcode if worker is not None else None
                if code not in (None, 0):
                    sources = ", ".join(f"'{name}'" for name in pool.sources_of(worker_id))
                    self.failure = f"the worker for source {sources} {describe_exit(code)} while tracing"
                    cancel.set()
                    return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(10 * _WATCH_S)


def _confirm(folder: Path, step: int, position: dict, required: bool) -> None:
    """The position after the traced step must be the folder's snapshot of `step`, where kept."""
    loaded = read_snapshot(folder, step)
    if loaded is None:
        if required:
            raise ConfigError(f"snapshot {step} of {folder} does not read cleanly; step 0 cannot be traced")
        return
    keys = ("step", "cursors", "spreads", "passes", "weights", "tokens", "dropped", "carry")
    ours = orjson.loads(orjson.dumps({k: position[k] for k in keys}))
    if ours != {k: loaded[0][k] for k in keys}:
        raise ConfigError(
            f"replaying to step {step - 1} does not reproduce the snapshot of step {step} in {folder}: "
            "that step was planned otherwise (a job that resumed there with another number of ranks, "
            "or from a position its ranks brought), so it cannot be traced from this folder"
        )


# -- from sample_id to file and row ------------------------------------------------------------
class _Shards:
    """Each source's shards by first ordinal, and the first ordinal of each file."""

    def __init__(self, catalog: list[SourceCatalog]) -> None:
        self._catalog = catalog
        self._firsts = [src.shards.column("first_ordinal").tolist() for src in catalog]
        self._file_first: list[dict[str, int]] = []
        for src in catalog:
            first: dict[str, int] = {}
            for shard in src.shards:
                first[shard.file] = min(first.get(shard.file, shard.first_ordinal), shard.first_ordinal)
            self._file_first.append(first)

    def locate(self, sid: int, tokens: int, batch_row: int, offset: int) -> Traced:
        source, ordinal, chunk = split_sample_id(sid)
        src = self._catalog[source]
        shard = src.shards[bisect.bisect_right(self._firsts[source], ordinal) - 1]
        if not shard.first_ordinal <= ordinal < shard.first_ordinal + shard.rows:
            raise OmniloadError(
                f"sample_id {sid}: row {ordinal} of source '{src.name}' is in no shard "
                "(a bug in omniload: please report it)"
            )
        return Traced(
            sample_id=sid,
            source=src.name,
            file=shard.file,
            format=shard.format,
            part=shard.start,
            row=ordinal - self._file_first[source][shard.file],
            chunk=chunk,
            tokens=tokens,
            batch_row=batch_row,
            offset=offset,
        )


def _rank_trace(dp_rank: int, batch: dict, shards: _Shards, layout: Layout, spec: Spec) -> RankTrace:
    cu = batch["cu_seqlens"].tolist()
    width = batch["input_ids"].shape[1]  # seq_len, or the rank's own length with --rank-tokens variable
    segments, padding = [], 0
    for k, (source, sid) in enumerate(zip(batch["source"].tolist(), batch["sample_id"].tolist())):
        length = cu[k + 1] - cu[k]
        if source < 0:
            padding += length
            continue
        segments.append(shards.locate(sid, length, *divmod(cu[k], width)))
    return RankTrace(dp_rank=dp_rank, ranks=_replica(layout, dp_rank, spec.pp_data), segments=segments, padding=padding)


def _replica(layout: Layout, dp_rank: int, pp_data: str) -> list[int]:
    ranks = [
        layout.rank_of({"dp": dp_rank, "tp": t, "cp": c, "pp": p})
        for p in range(layout.pp)
        for c in range(layout.cp)
        for t in range(layout.tp)
    ]
    return sorted(r for r in ranks if layout.needs_data(r, pp_data))


# -- output ----------------------------------------------------------------------------------------
_COLUMNS = ("batch row", "at", "tokens", "sample_id", "source", "file", "part", "row", "chunk")


def format_trace(trace: StepTrace) -> str:
    """A readable table per data-parallel rank."""
    origin = (
        f"snapshot {trace.snapshot}, {trace.replayed} steps replayed"
        if trace.snapshot is not None
        else "the job's start"
    )
    lines = [f"step {trace.step} (from {origin}; dp {trace.layout['dp']}, world {trace.layout['world']})"]
    lines += [f"note: {note}" for note in trace.notes]
    for rank in trace.ranks:
        tokens = sum(s.tokens for s in rank.segments)
        lines.append(
            f"\ndp rank {rank.dp_rank} (ranks {_ranges(rank.ranks)}): {len(rank.segments)} segments, "
            f"{tokens} tokens, {rank.padding} padding"
        )
        rows = [
            [
                str(s.batch_row),
                str(s.offset),
                str(s.tokens),
                str(s.sample_id),
                s.source,
                s.file,
                part_name(s.format, s.part),
                str(s.row),
                str(s.chunk),
            ]
            for s in rank.segments
        ]
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(_COLUMNS)]
        for cells in [list(_COLUMNS), *rows]:
            lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip())
    return "\n".join(lines)


def _ranges(ranks: list[int]) -> str:
    """0-3,8-11: a replica of many ranks in a line."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"
