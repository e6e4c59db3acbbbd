"""The source-worker process: read shards, transform, write records into its rings.

A worker serves one or more lanes; a lane is one source's share of positions (its turns, see
omniload.order) with its own ring. A re-split moves lanes between running workers: a worker
lets go of a lane when its ring asks (omniload/formats/ring.py, handover) and takes on the
lanes its inbox brings.
The worker never blocks on one full ring while another has room, so a worker serving several
sources cannot stall the coordinator. It exits when its lanes are done, when
the coordinator is gone, or (killed) when the coordinator stops it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from omniload.errors import ConfigError
from omniload.formats.lane_config import ChatConfig, ImageConfig, LaneConfig, Pretokenized, WorkerConfig
from omniload.formats.records import chat_record, doc_record, error_record, skip_record
from omniload.formats.ring import RecordTooLarge, Ring
from omniload.formats.shards import BadFile, Shard, part_name
from omniload.order import (
    ShardOrder,
    group_members,
    groups_per_epoch,
    interleave_rows,
    row_permutation,
    turns_of_lane,
)
from omniload.storage.disk_cache import DiskCache
from omniload.storage.files import Files
from omniload.storage.objects import StoreError
from omniload.storage.urls import is_remote, redact
from omniload.workers.chat import ChatError, ChatSample, encode, jinja_render
from omniload.workers.images import DECODE_ERRORS, ImageTransform, load_image_transform, place_images, text_pieces
from omniload.workers.readers import DATA_ERRORS, LOCAL, iter_slices, use_system_allocator, warm
from omniload.workers.transforms import Transform, load_transform
from omniload.workers.watchdog import exit_with

_BURST = 64  # records per lane before the worker looks at its other lanes
# positions transformed at once, never into another lane's turn: the tokenizers library encodes
# 256 texts a call about 4% faster per token than 64; their int32 tokens (1-4x their text) are
# held per lane. Samples with images hold their decoded pixels too: fewer of them at once. A
# group starts at _FIRST_ROWS and doubles: a restarted worker's first records come out as soon
# as before, while the planner waits on its ring
_TRANSFORM_ROWS, _IMAGE_ROWS, _FIRST_ROWS = 256, 64, 32
# ...and every lane of a worker holds its batch at once (texts, encodings, ids): a worker's lanes
# share this many positions. One worker serving 16 lanes held 112 MB PSS at 256 each, 76 at 64
_WORKER_ROWS = 1024
_IDLE_MIN_S, _IDLE_MAX_S = 50e-6, 5e-3


def run_worker(config: WorkerConfig, inbox: Connection | None = None) -> None:
    """Process entry point (forked by the coordinator's pool). `inbox` brings lanes to take on
    during a re-split.

    A shard's errors travel as ERROR records; an error outside any shard (a bug) ends the
    worker with code 1, after its traceback and one line naming the worker and its sources
    on stderr, which is the coordinator's: both redacted as the coordinator's log lines are
    (a store's error may quote a signed URL or a key)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    # A worker is one core, as autoscaling counts them: the tokenizers library's own thread
    # pool would spread each worker over every core (and a malloc arena per thread with it)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    exit_with(config.coordinator_pid)
    try:
        _serve(config, inbox)
    except Exception as exc:
        sources = ", ".join(sorted({f"'{lane.source_name}'" for lane in config.lanes}))
        print(redact(traceback.format_exc()), end="", file=sys.stderr)
        print(
            redact(f"omniload: worker {os.getpid()} for source {sources} failed: {_cause(exc)}"),
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


def _serve(config: WorkerConfig, inbox: Connection | None = None) -> None:  # noqa: C901, PLR0912, PLR0915  (the worker's loop: to split into its phases)
    set_up_allocators()
    lanes: list[LaneConfig] = []
    rings: list[Ring] = []
    access: list[Files] = []
    published: list[tuple[int, int]] = []  # store counters already added to each ring
    producers: list[Generator[tuple, None, None]] = []
    pending: list[tuple | None] = []
    set_up: list[bool] = []  # the lane's first record is out: its transform loaded, shards opened
    live: list[int] = []

    def take_on(lane: LaneConfig, held: int) -> None:
        """Start producing `lane`, one of the `held` lanes this worker will then hold."""
        lanes.append(lane)
        rings.append(Ring.attach(Path(lane.ring_path)))
        access.append(_files_for(lane))
        published.append((0, 0))
        producers.append(_produce(lane, access[-1], held))
        pending.append(None)
        set_up.append(False)
        live.append(len(lanes) - 1)

    for lane in config.lanes:
        take_on(lane, len(config.lanes))
    awaiting = False  # it let its last lane go: lanes to take on are on their way
    idle = _IDLE_MIN_S

    def release_asked() -> None:
        """Let go every lane a re-split gives to another worker. Checked before each lane's
        burst, for all lanes: one pass over many lanes with a costly transform takes seconds,
        and the planner waits on a moved lane until its new worker has it."""
        nonlocal awaiting
        for j in [j for j in live if rings[j].release_asked()]:
            live.remove(j)
            producers[j].close()  # its unwritten record is the next worker's first
            pending[j] = None
            rings[j].confirm_release()
            awaiting = not live

    while live or awaiting:
        if inbox is not None and inbox.poll():
            try:
                incoming = inbox.recv()
                held = len(live) + len(incoming)
                for lane in incoming:
                    take_on(lane, held)
                awaiting = False
            except (EOFError, OSError):  # the coordinator is gone: the watchdog ends this process
                inbox = None
        progressed = False
        for i in list(live):
            release_asked()
            if i not in live:
                continue
            started, began, tokens = time.thread_time_ns(), time.perf_counter_ns(), 0
            for _ in range(_BURST):
                if pending[i] is None:
                    pending[i] = next(producers[i], None)
                    if pending[i] is None:
                        live.remove(i)
                        break
                    if not set_up[i]:  # setting the lane up is not what its tokens cost (a moved
                        set_up[i] = True  # lane's new worker would look costly and move it again)
                        started = time.thread_time_ns()
                record = pending[i]
                assert record is not None  # taken just above; None ended the lane
                if not _write(rings[i], record, lanes[i]):
                    break
                tokens += _tokens_in(record)
                pending[i] = None
                progressed = True
            # what this lane cost: the autoscaler splits the budget by CPU time per token, and
            # grows the pool only while its workers are busy (wall time: reads' waits count)
            rings[i].count_work(time.thread_time_ns() - started, tokens, time.perf_counter_ns() - began)
            if access[i] is not LOCAL:
                counters, (retries, fetched) = access[i].counters, published[i]
                rings[i].count_store(counters.retries - retries, counters.fetched - fetched, counters.held)
                published[i] = (counters.retries, counters.fetched)
        if not progressed:
            time.sleep(idle)
            idle = min(idle * 2, _IDLE_MAX_S)
        else:
            idle = _IDLE_MIN_S
    for ring in rings:
        ring.close()
    for files in access:
        files.close()


def _files_for(lane: LaneConfig) -> Files:
    """The lane's way to its files: its own block cache when they are in a store."""
    if not any(is_remote(shard.file) for shard in lane.shards):
        return LOCAL
    cache = DiskCache(lane.cache_dir, lane.cache_limit) if lane.cache_dir else None
    return Files(lane.store, lane.read_ahead, cache)


def _tokens_in(record: tuple) -> int:
    """Tokens of a DOC record (its payload is a view of the int32 tokens; others carry bytes)."""
    return len(record[1]) if isinstance(record[1], memoryview) else 0


def _write(ring: Ring, record: tuple, lane: LaneConfig) -> bool:
    try:
        return ring.try_write(*record)
    except RecordTooLarge as exc:
        return ring.try_write(*error_record(0, 0, f"{exc}: raise --ring-mb (now {ring.capacity >> 20} MB)"))


def transform_rows(lane: LaneConfig, lanes: int) -> int:
    """Positions a lane transforms at once in a worker holding `lanes` lanes (its own included)."""
    if lane.images is not None:
        return _IMAGE_ROWS
    return max(_FIRST_ROWS, min(_TRANSFORM_ROWS, _WORKER_ROWS // lanes))


def _produce(lane: LaneConfig, files: Files = LOCAL, held: int = 1) -> Generator[tuple, None, None]:
    """Records of this lane in the source's deterministic order, from (start_group, start_pos),
    in a worker holding `held` lanes (transform_rows). An ERROR record is the lane's last: the
    source cannot go on."""
    transform: Callable[[list], list]
    try:
        transform = load_transform(lane.tokenizer)
        if lane.images is not None:
            transform = _with_images(transform, load_image_transform(lane.images), lane.images)
        if lane.chat is not None:
            transform = _with_chats(transform, lane.chat)
    except ConfigError as exc:  # the coordinator loaded it, but the user's module may fail here
        yield error_record(lane.start_group, lane.start_pos, f"{exc} (loading it in the source's worker)")
        return
    num_shards = len(lane.shards)
    end = lane.epochs * groups_per_epoch(num_shards, lane.interleave) if lane.epochs else None
    k, first_pos = lane.start_group, lane.start_pos
    order = ShardOrder(num_shards, lane.seed, lane.source_index)
    while end is None or k < end:
        if (yield from _produce_group(lane, order, transform, k, first_pos, files, transform_rows(lane, held))):
            return
        k += 1
        first_pos = 0


def _produce_group(  # noqa: C901, PLR0912  (one branch a record kind: to split)
    lane: LaneConfig,
    order: ShardOrder,
    transform: Callable[[list], list],
    k: int,
    first_pos: int,
    files: Files,
    at_most: int,
) -> Generator[tuple, None, bool]:
    """This lane's turns of group k from position first_pos: the group's shards read together,
    their rows taken in turn (omniload.order.interleave_rows), each shard streamed a slice at a
    time, and the rows transformed `at_most` positions at a time across the shards (one
    batch of tokens held per lane, not one per shard; never into another lane's turn: its rows
    are that lane's to transform). An unreadable shard's rows (from where reading failed) are
    skipped (on_bad_file=skip) or its first due row is an ERROR; returns True after an ERROR."""
    members = [order.at(g) for g in group_members(k, len(lane.shards), lane.interleave)]
    shards = [lane.shards[index] for _, index in members]
    turns = list(turns_of_lane(lane.lane, lane.num_lanes, k, sum(shard.rows for shard in shards), first_pos))
    if not turns:  # a group smaller than a turn is often wholly another lane's
        return False
    member, row = interleave_rows([shard.rows for shard in shards])
    # a group (or a restarted one) reads only the rows this lane still has due: each shard's
    # from the first of them, holding those rows only
    positions = np.concatenate([np.arange(turn.start, turn.stop, dtype=row.dtype) for turn in turns])
    rows = [
        _open_shard(lane, epoch, index, row[positions[member[positions] == m]], files)
        for m, (epoch, index) in enumerate(members)
    ]
    if files is not LOCAL:  # the next group's first bytes come in while this one is read
        for g in group_members(k + 1, len(lane.shards), lane.interleave):
            warm(lane.shards[order.at(g)[1]], lane.column, lane.image_column, files)

    def due(m: int, pos: int) -> int:  # shard m's rows this lane has from position pos on
        return int(np.count_nonzero(member[positions[positions >= pos]] == m))

    def unreadable(m: int, pos: int) -> tuple:
        gone = rows[m]
        assert isinstance(gone, _Unreadable)  # a row with no sample is one that could not be read
        if gone.fatal:  # the store, not the file: skipping would change what the batches hold
            return error_record(k, pos, gone.message)
        if not lane.skip_bad_files:
            return error_record(
                k, pos, f"{gone.message} (the job stops on a bad file; --on-bad-file skip skips it instead)", True
            )
        return skip_record(k, pos, "" if gone.said else gone.say_once(due(m, pos)))

    dropped_said = False  # a dropped conversation's warning, once per group

    runs: list[range] = []  # the lane's turns, those back to back as one (a source's only lane has them all)
    for turn in turns:
        if runs and runs[-1].stop == turn.start:
            runs[-1] = range(runs[-1].start, turn.stop)
        else:
            runs.append(turn)
    for batch in _batches(runs, _FIRST_ROWS, at_most):
        values: dict[int, object] = {}  # position: its raw value, for the rows that could be read
        ordinals: dict[int, int] = {}  # position: its row within its shard's file part
        for pos in batch:
            m, r = int(member[pos]), int(row[pos])
            reading = rows[m]
            if isinstance(reading, _ShardRows):
                try:
                    values[pos], ordinals[pos] = reading.take(r), int(reading.order[r])
                except _ReadFailed as exc:  # part-way through the shard: the rest of it is unreadable
                    rows[m] = _Unreadable(exc.message, exc.fatal)
        try:
            samples = dict(zip(values, _transform(transform, list(values.values())))) if values else {}
        except Exception as exc:  # the user's transform; its error must reach the user
            names = ", ".join(sorted({shards[int(member[pos])].file for pos in values}))
            yield error_record(k, next(iter(values)), f"{names}: transform failed: {_cause(exc)}")
            return True
        values.clear()  # the raw values go before the records are written
        for pos in batch:
            m = int(member[pos])
            sample = samples.pop(pos, None)
            if sample is None:
                yield unreadable(m, pos)
                if not lane.skip_bad_files or rows[m].fatal:
                    return True
            elif isinstance(sample, _BadSample):  # one sample's image: the rest of the file is fine
                message = (
                    f"{shards[m].file}: {part_name(shards[m].format, shards[m].start)}, "
                    f"row {ordinals[pos]}: {sample.message}"
                )
                if not lane.skip_bad_files:
                    yield error_record(
                        k,
                        pos,
                        f"{message} (the job stops on a bad file; --on-bad-file skip skips the sample instead)",
                        bad_input=True,
                    )
                    return True
                yield skip_record(k, pos, f"skipped a sample: {message}")
            elif isinstance(sample, ChatSample):
                yield chat_record(
                    k, pos, shards[m].first_ordinal + ordinals[pos], sample.tokens, sample.mask, sample.truncated
                )
            elif isinstance(sample, _Dropped):
                why = "longer than" if lane.chat is not None and lane.chat.drop_long else "whose first reply exceeds"
                said = (
                    ""
                    if dropped_said
                    else f"{shards[m].file}: dropping conversations {why} --seq-len (the first of "
                    f"{sample.tokens} tokens); omniload status counts them"
                )
                dropped_said = True
                yield skip_record(k, pos, said, dropped=True)
            else:
                yield doc_record(k, pos, shards[m].first_ordinal + ordinals[pos], *sample)
    rows.clear()
    release_freed_memory()  # the group's slices, now freed
    return False


def _batches(runs: list[range], first: int, at_most: int) -> Iterator[range]:
    """The positions of `runs` in batches, none across two runs: the first of `first` positions,
    each next one twice the last, up to `at_most`."""
    size = first
    for run in runs:
        start = run.start
        while start < run.stop:
            yield range(start, min(start + size, run.stop))
            start += size
            size = min(2 * size, at_most)


def _open_shard(
    lane: LaneConfig, epoch: int, index: int, due: np.ndarray, files: Files = LOCAL
) -> _ShardRows | _Unreadable:
    """A shard's rows at the row positions `due` (its first due slice read now, so an
    unreadable file is known at once), or why it cannot be read."""
    shard = lane.shards[index]
    order = row_permutation(shard.rows, lane.seed, lane.source_index, epoch, index, shard.slicing)
    keep = None
    if lane.num_lanes > 1:  # the other lanes' rows of a slice are theirs to read: not held here
        keep = np.zeros(shard.rows, dtype=bool)
        keep[order[due]] = True
    rows = _ShardRows(shard, lane.column, order, lane.image_column, files, lane.pretokenized, keep)
    if not len(due):  # no turn of this lane takes a row of it, or every one was delivered before a restart
        return rows
    try:
        rows.load(int(due.min()))
    except _ReadFailed as exc:
        return _Unreadable(exc.message, exc.fatal)
    return rows


@dataclass(slots=True)
class _Unreadable:
    """A shard that could not be read: the message, said with the file's first skipped row only."""

    message: str
    fatal: bool = False  # the store failed (past its retries), not the file: the job stops
    said: bool = False

    def say_once(self, rows: int) -> str:
        if self.said:
            return ""
        self.said = True
        return f"skipped {rows} rows: {self.message}"


class _ReadFailed(Exception):
    """Reading a shard's next slice failed; the message names the file and the part."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.message, self.fatal = message, fatal


class _ShardRows:
    """One shard's rows in their order (order.row_permutation: the slices one after another,
    each one's rows shuffled), read a slice at a time; a slice is dropped when the next is read,
    a value once taken, and the rows of `keep` alone are held (the other lanes' rows are theirs).
    Token ids held stay views of their slice's one array (readers._to_values)."""

    fatal = False  # (an _Unreadable's field: a shard read so far is never fatal)

    def __init__(
        self,
        shard: Shard,
        column: str,
        order: np.ndarray,
        image_column: str | None = None,
        files: Files = LOCAL,
        pretokenized: Pretokenized | None = None,
        keep: np.ndarray | None = None,
    ) -> None:
        self.order = order
        self._keep = keep  # by file row: the rows this lane takes (None: all of them)
        self._files, self._pretokenized = files, pretokenized
        self._shard, self._column, self._image_column = shard, column, image_column
        self._slicing = shard.slicing
        self._slices: Iterator | None = None
        self._slice, self._values = -1, list[object]()  # the slice held and its values

    def load(self, r: int) -> None:
        """Hold the slice of row position r (positions only move forward); raises _ReadFailed."""
        self._hold(int(self._slicing.locate(int(self.order[r]))[0]))

    def take(self, r: int) -> object:
        """Row position r's raw value (positions are asked for in increasing order); raises
        _ReadFailed."""
        wanted, i = self._slicing.locate(int(self.order[r]))
        self._hold(int(wanted))
        value, self._values[i] = self._values[i], None
        return value

    def _hold(self, wanted: int) -> None:
        if wanted == self._slice:
            return
        self._values = []  # let the last slice go before reading the next
        try:
            if self._slices is None or (wanted > self._slice + 1 and self._shard.strided):
                # the slices between are other lanes' turns: start reading at this one
                self._slices = iter_slices(
                    self._shard, self._column, wanted, self._image_column, self._files, self._pretokenized
                )
                self._slice = wanted - 1
            while self._slice < wanted:  # iter_slices checks each slice's rows against the index
                self._values = next(self._slices)
                self._slice += 1
            if self._keep is not None:
                # several lanes of a source read the same slices, each holding only its own rows:
                # 4 lanes each holding whole slices cost a worker serving them all 4 copies
                members = self._slicing.members(wanted)
                for i in np.flatnonzero(~self._keep[members.start : members.stop : members.step]).tolist():
                    self._values[i] = None
        except BadFile as exc:
            raise _ReadFailed(f"{self._shard.file}: {exc}") from None
        except StoreError as exc:  # names the object already
            raise _ReadFailed(str(exc), fatal=True) from None
        except DATA_ERRORS as exc:  # bad data readers.py did not foresee is still the file's; other errors are
            raise _ReadFailed(
                f"{self._shard.file}: cannot read {part_name(self._shard.format, self._shard.start)}: {_cause(exc)}"
            ) from None  # bugs: the worker dies


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _transform(transform: Callable[[list], list], values: list) -> list:
    samples = transform(values)
    if len(samples) != len(values):
        raise ValueError(f"returned {len(samples)} results for {len(values)} values")
    return [s if isinstance(s, (tuple, _BadSample, ChatSample, _Dropped)) else (_ids(s),) for s in samples]


def _ids(sample: object) -> np.ndarray:
    """A transform's token ids as a record takes them: int32, or uint16 as given (the byte
    transform's: its record then needs no check that every id fits)."""
    if isinstance(sample, np.ndarray) and sample.dtype == np.uint16:
        return np.ascontiguousarray(sample)
    return np.ascontiguousarray(sample, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class _Dropped:
    """A conversation too long for seq_len, dropped (--long-chats)."""

    tokens: int


def _with_chats(transform: Callable[[list], list], config: ChatConfig) -> Callable[[list], list]:
    """The text transform extended to conversations (workers/chat.py): each row's messages
    rendered into pieces, every piece of the batch tokenized in one call."""
    render = jinja_render(config) if config.template is not None else None

    def tokenize(texts: list[str]) -> list[np.ndarray]:
        return [ids for (ids,) in _transform(transform, texts)] if texts else []

    def samples(values: list) -> list:
        return [
            _BadSample(str(s)) if isinstance(s, ChatError) else _Dropped(s) if isinstance(s, int) else s
            for s in encode(values, config, tokenize, render)
        ]

    return samples


@dataclass(frozen=True, slots=True)
class _BadSample:
    """A sample whose images cannot be decoded or placed; the message says which and why."""

    message: str


def _with_images(transform: Transform, decode: ImageTransform, config: ImageConfig) -> Callable[[list], list]:
    """The text transform extended to (text, images) values: the text's pieces between image
    markers tokenized in one call, the images decoded, placeholders put in (workers/images.py)."""

    def samples(values: list) -> list:  # of (text, images) values
        pieces = [
            text_pieces(text if isinstance(text, str) else "" if text is None else str(text)) for text, _ in values
        ]
        flat = iter(_transform(transform, [p for row in pieces for p in row]))
        out: list[Any] = []  # (ids, image positions, pixels), or a _BadSample
        for row, (_, images) in zip(pieces, values):
            tokens = [next(flat)[0] for _ in row]
            try:
                ids, at = place_images(tokens, len(images), config)
            except ValueError as exc:
                out.append(_BadSample(str(exc)))
                continue
            pixels = np.empty((len(images), 3, config.height, config.width), dtype=np.uint8)
            for i, data in enumerate(images):
                try:
                    pixels[i] = decode(data)
                except DECODE_ERRORS as exc:
                    out.append(_BadSample(f"image {i} cannot be decoded: {_cause(exc)}"))
                    break
            else:
                out.append((ids, at, pixels))
        return out

    return samples


def release_freed_memory() -> None:
    """Give freed buffers back to the OS: a worker's memory is the shard it holds, not the
    largest shard it ever read (glibc keeps freed heap otherwise)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MAPPED_FROM = 256 << 10


def set_up_allocators() -> None:
    """How a worker allocates, so that its memory follows what it holds now: Arrow's buffers
    from the system allocator (readers.use_system_allocator), and a buffer of 256 KB or more
    (a slice's decoded column, a group's row indexes) mapped rather than grown from the heap,
    and unmapped when freed. glibc's default raises that threshold to the largest buffer freed
    so far (up to 32 MB); such buffers then come from the heap, and the holes they leave stay
    resident, more or less from run to run (docs/benchmarks.md, Loader memory). Call at
    process start."""
    use_system_allocator()
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, _MAPPED_FROM)  # best effort: 0 (refused) leaves glibc's default


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()
