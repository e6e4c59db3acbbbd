"""Each source's shuffle: its units spread over a horizon of tokens, drawn in key order; pure.

A source's documents arrive in their deterministic order (omniload.order) and are cut into
units (plan/units.py). Each unit gets a key on the source's clock, which counts what the
documents taken this epoch before it hold, in units of 2 bytes: a token of ids that fit 16 bits
(the usual vocabulary), 2 of a larger one, and a sample's pixels by their bytes (a 224x224
image: 75k). So the horizon bounds the disk a spread holds, whatever the source: a source of
images spreads over fewer samples. A document taken at clock r that makes c units puts
them at max(r, F) + H (k + u) / c, k = 0..c-1 for its units in a seeded random order, u a
seeded phase in [0, 1), H the horizon (or `stretch` x L for a document so long that L / H would
be a large share of the source's tokens) and F the fill. So a one-unit document (most) waits a
uniform share of the horizon, and a long document's chunks are spaced evenly over it: the
document reaches the steps of a whole horizon a chunk at a time, its share of each step L / H
of the source's tokens.

The fill is the epoch's start. The documents of its first F tokens are all read before the
first draw, and their units spread over [F, F + H] whatever their place among them: an epoch
of at most F tokens is therefore drawn as a global shuffle (every unit's key uniform over the
horizon), and a longer one starts from a shuffle of its first F tokens that the documents read
later join as their keys come due. Without it, the first steps could draw only from the few
documents read first, each a large share of them, and a run shorter than the epoch would see
mostly the start of the reading order. Delivering the first D tokens reads F plus about
(D H / F) more; in steady state the spread holds about H / 2 tokens.

Units are drawn in key order (then sample_id), and a unit only once no document still unread
can come before it: documents read later have keys at or after the clock, so a unit whose key
is below the clock is next (below, not at: a unit drawn is then below every key still to come,
so "above the frontier" says "not drawn"), and once the epoch has been read everything is. The order is
therefore a function of the documents and the seed alone, however the reads and draws
interleave. A spread covers one epoch: at its end the spread is drawn empty before the next
epoch's first unit is drawn, so a document never meets its next epoch's copy (the stepper
reads the next epoch into a spread of its own meanwhile). A horizon
longer than the epoch reads the whole epoch and draws it in key order: a global shuffle of the
epoch's units, each long document spread evenly over it.

A draw passes over a unit whose document already holds its share of the step (`cap` tokens
over all ranks) when another unit due now is within _SCAN; a passed-over unit stays first in
line for a later step (the planner keeps each rank's share too: planner.plan_step's doc_cap).
When none is, the caller may read on (more documents make more units due) before it lets the
cap give way: at an epoch's start few documents have been read, and a long one among them
would otherwise fill the first steps.

Tokens never wait here: a waiting document's arrays are in a `UnitStore` (the coordinator's is
files on local disk, coordinator/pool/spill.py); a spread holds a few ints per waiting
document and per waiting unit, and makes a unit's segments when it is drawn, reading only that
unit's tokens.

Position (SpreadPosition): the oldest document with a unit waiting (`start`), the clock there,
the horizon, the greatest (key, sample_id) drawn (`frontier`) and the ones below it not drawn
yet (`passed`). A restore reads the documents from `start` to the source's cursor again and
keeps each unit above the frontier or passed.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from omniload.coordinator.plan.documents import Doc
from omniload.coordinator.plan.packer import DocKey, Segment
from omniload.coordinator.plan.units import Unit, chunk_unit, unit_count, unit_span, units_of
from omniload.order import sample_id
from omniload.state import SpreadPosition

_SCAN = 64  # units due now looked at past the first for one whose document is under its cap
_BUCKETS = 64  # the horizon's keys are kept in about this many buckets; the first one in a heap
_MASK64 = (1 << 64) - 1
_TURNS_IN_PYTHON = 24  # units a document up to which their order is computed in Python, not numpy
_UINT16, _MASKED = 1, 2  # a waiting document's flags; images: their count from bit 8
_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.uint16))


class UnitStore(Protocol):
    """Where waiting documents' arrays are kept until their units are drawn."""

    def put(self, parts: Sequence[np.ndarray], units: int) -> int:
        """Keep the arrays one after another; returns their handle. `units` releases free them."""
        ...

    def read(self, handle: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        """`size` bytes from `offset` bytes into what `put` kept at `handle`."""
        ...

    def release(self, handle: int) -> None:
        """One unit of the document at `handle` was drawn."""
        ...


def _held(doc: Doc) -> int:
    """What a document holds in the store, in clock units of 2 bytes."""
    size = doc.tokens.nbytes
    if doc.mask is not None:
        size += doc.mask.nbytes
    if doc.pixels is not None:
        size += doc.pixels.nbytes + 4 * (0 if doc.image_at is None else len(doc.image_at))
    return (size + 1) // 2


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """_mix64 of each element of a uint64 array (wrapping, as the masks do)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of an int (a few multiplications,
    where a seeded numpy Generator costs ~10 us a document)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Spread:
    """One source's units of one epoch, drawn in key order (see the module's doc).

    Lifecycle: OPEN (documents are added as the draws need them) -> ENDED (`end()`: the epoch
    has been read) -> EXHAUSTED (ended, and every unit drawn). A spread made from a position
    RESTORES first: the documents from its start to the cursor are added again, keeping the
    units not drawn, until `restored()`."""

    def __init__(
        self,
        source: int,
        seed: int,
        horizon: int,
        fill: int,
        store: UnitStore,
        seq_len: int,
        epoch_end: int,
        stretch: float = 0.0,
        bucket_rows: int = 0,
        rows: int = 0,
        image_hw: tuple[int, int] | None = None,
        position: SpreadPosition | None = None,
    ) -> None:
        if position is not None:
            horizon, fill = position.horizon, position.fill
        if horizon < 1 or fill < 0:
            raise ValueError(f"a spread's horizon must be >= 1 token and its fill >= 0, got {horizon} and {fill}")
        self.source, self.horizon, self.fill, self.epoch_end = source, horizon, fill, epoch_end
        self._stretch = stretch
        self._seed_key = _mix64(_mix64(seed & _MASK64) ^ source)
        self._store, self._seq_len, self._bucket_rows, self._rows = store, seq_len, bucket_rows, rows
        self._image_hw = image_hw
        self.clock = 0 if position is None else position.clock
        self.frontier: tuple[int, int] = (-1, -1) if position is None else position.frontier
        self._restoring = None if position is None else set(position.passed)
        self._passed: set[tuple[int, int]] = set()  # waiting units below the frontier
        self.ended = False
        self.waiting_units = 0
        # Tokens drawn since end(): the stepper reads as many of the next epoch ahead. Kept in
        # the position with `ended`, so that a resumed job reads ahead where this one did.
        self.drawn_since_end = 0 if position is None else position.drawn_since_end
        # Waiting documents: slot s holds handle, length, units left, clock, group, pos, ordinal,
        # flags at _docs[8 s : 8 s + 8] (one array: 64 bytes a document, one slice to read them)
        self._docs = array("q")
        self._free: list[int] = []
        self._oldest: deque[int] = deque()  # slots in reading order (the first ones may have no unit left)
        # Waiting units as (key, sample_id, slot, k): the first bucket's in a heap, later ones flat
        self._width = max(1, horizon // _BUCKETS)
        self._heap: list[tuple[int, int, int, int]] = []
        self._bucket = -1  # the last bucket moved into the heap
        self._later: dict[int, array[int]] = {}
        self._later_order: list[int] = []  # a heap of the buckets in _later

    # -- adding documents ------------------------------------------------------------------
    def add(self, doc: Doc) -> None:
        """Take the source's next document: its units wait at their keys, its arrays in the
        store (while restoring, only the units not drawn). Advances the clock. Raises
        ValueError for a document that cannot be placed (units.unit_count)."""
        tokens = doc.tokens
        length = len(tokens)
        whole = doc.pixels is not None or doc.mask is not None
        if 0 < length <= self._seq_len and not whole and self._restoring is None:
            # most documents: one unit of text (unit_count's 1 and _held's size, inline: this
            # runs for every document read)
            r, self.clock = self.clock, self.clock + (tokens.nbytes + 1) // 2
            key = self._one_key(self._mixed(doc.group, doc.pos), r)
            self._push(key, sample_id(doc.source, doc.ordinal, 0), self._keep(doc, r, 1), 0)
            return
        count = unit_count(length, self._seq_len, self._bucket_rows, whole)
        held = _held(doc)
        r, self.clock = self.clock, self.clock + held
        if not count:
            return
        if count == 1 and self._restoring is None:  # the other one-unit documents: no list
            key = self._keys((doc.group, doc.pos), r, 1, held)[0]
            self._push(key, sample_id(doc.source, doc.ordinal, 0), self._keep(doc, r, 1), 0)
            return
        bucketed = bool(self._bucket_rows) and length > self._seq_len and not whole
        units = [
            (key, sample_id(doc.source, doc.ordinal, k * self._bucket_rows if bucketed else k), k)
            for k, key in enumerate(self._keys(doc.origin, r, count, held))
        ]
        if self._restoring is not None:
            passed = self._restoring
            units = [u for u in units if u[:2] > self.frontier or u[:2] in passed]
            self._passed.update(u[:2] for u in units if u[:2] < self.frontier)
            if not units:
                return
        slot = self._keep(doc, r, len(units))
        for key, sid, k in units:
            self._push(key, sid, slot, k)

    def restored(self) -> None:
        """The documents up to the cursor have been added again: later ones keep every unit."""
        self._restoring = None

    def _keys(self, origin: tuple[int, int], clock: int, count: int, held: int) -> list[int]:
        """The keys of a document's `count` units, taken at `clock`, holding `held` clock units
        (see the module's doc)."""
        mixed = self._mixed(*origin)
        if count == 1:
            return [self._one_key(mixed, clock)]
        phase = mixed >> 32  # u = phase / 2**32
        base = max(clock, self.fill)
        span = max(self.horizon, int(self._stretch * held))
        if count <= _TURNS_IN_PYTHON:  # a seeded order of the units (a numpy Generator: ~15 us)
            turns = sorted(range(count), key=lambda k: _mix64(mixed ^ k))
        else:
            turns = np.argsort(_mix64_array(np.arange(count, dtype=np.uint64) ^ np.uint64(mixed))).tolist()
        return [base + (span * ((turn << 32) + phase)) // (count << 32) for turn in turns]

    def _mixed(self, group: int, pos: int) -> int:
        """The seeded 64-bit hash of a document's place (its units' phase and order)."""
        # CPython hashes a tuple of ints the same in every process and run (only str and bytes
        # hashes are salted), but nearly linearly: consecutive documents' hashes differ by one
        # of a few constants, which drew a source's documents in a lattice of its reading order
        # (0.03 nats worse at 10x the short run). The finalizer breaks that: ~1 us a document.
        return _mix64(hash((self._seed_key, group, pos)) & _MASK64)

    def _one_key(self, mixed: int, clock: int) -> int:
        """The key of a one-unit document taken at `clock`: a uniform share of the horizon."""
        return max(clock, self.fill) + ((self.horizon * (mixed >> 32)) >> 32)

    def _keep(self, doc: Doc, clock: int, units: int) -> int:
        tokens = doc.tokens
        flags = _UINT16 if tokens.itemsize == 2 else 0  # (ids are uint16 or int32: records.py)
        if doc.mask is None and doc.pixels is None:  # text: its tokens alone
            handle = self._store.put((tokens,), units)
        else:
            parts: list[np.ndarray] = [tokens]
            if doc.mask is not None:
                parts.append(doc.mask)
                flags |= _MASKED
            if doc.pixels is not None and doc.image_at is not None:
                parts += [doc.image_at.astype(np.int32, copy=False), doc.pixels]
                flags |= len(doc.image_at) << 8
            handle = self._store.put(parts, units)
        docs = self._docs
        if self._free:  # (the fields one by one: a slice from a new array costs twice as much)
            slot = self._free.pop()
            at = 8 * slot
            docs[at], docs[at + 1], docs[at + 2], docs[at + 3] = handle, len(tokens), units, clock
            docs[at + 4], docs[at + 5], docs[at + 6], docs[at + 7] = doc.group, doc.pos, doc.ordinal, flags
        else:
            slot = len(docs) // 8
            docs.extend((handle, len(tokens), units, clock, doc.group, doc.pos, doc.ordinal, flags))
        self._oldest.append(slot)
        return slot

    def _push(self, key: int, sid: int, slot: int, k: int) -> None:
        self.waiting_units += 1
        bucket = key // self._width
        if bucket <= self._bucket:
            heapq.heappush(self._heap, (key, sid, slot, k))
            return
        later = self._later.get(bucket)
        if later is None:
            later = self._later[bucket] = array("q")
            heapq.heappush(self._later_order, bucket)
        later.extend((key, sid, slot, k))

    def _first_due(self) -> tuple[int, int, int, int] | None:
        """The first waiting unit, moving the next bucket into the heap when it is empty."""
        while not self._heap and self._later_order:
            self._bucket = heapq.heappop(self._later_order)
            flat = self._later.pop(self._bucket)
            self._heap.extend(zip(flat[0::4], flat[1::4], flat[2::4], flat[3::4]))  # in place: draw holds it
            heapq.heapify(self._heap)
        return self._heap[0] if self._heap else None

    # -- drawing ---------------------------------------------------------------------------
    def end(self) -> None:
        """The epoch has been read: every waiting unit is due."""
        self.ended = True

    def ready(self) -> bool:
        """Whether a unit can be drawn now (else add the source's next document, or end())."""
        heap = self._heap
        if not heap and self._first_due() is None:
            return False
        return self.ended or heap[0][0] < self.clock

    @property
    def exhausted(self) -> bool:
        return self.ended and not self.waiting_units

    def draw(self, step_tokens: dict[DocKey, int], cap: int, give_way: bool = True) -> Unit | None:
        """The first unit due whose document stays within `cap` tokens of this step (or has
        none in it yet). When none of the next _SCAN due does: the first unit due if
        `give_way`, else None (and nothing drawn). Must be ready()."""
        heap = self._heap
        chosen = heapq.heappop(heap)
        if not self._fits(chosen, step_tokens, cap):
            passed = [chosen]
            while len(passed) < _SCAN and self.ready():
                candidate = heapq.heappop(heap)
                if self._fits(candidate, step_tokens, cap):
                    chosen = candidate
                    break
                passed.append(candidate)
            else:
                if not give_way:
                    for entry in passed:
                        heapq.heappush(heap, entry)
                    return None
                chosen = passed.pop(0)
            for entry in passed:  # first in line again (all below `chosen`: passed over)
                heapq.heappush(heap, entry)
                self._passed.add(entry[:2])
        key, sid, slot, k = chosen
        self.waiting_units -= 1
        drawn = (key, sid)
        if drawn > self.frontier:
            self.frontier = drawn
        if self._passed:
            self._passed.discard(drawn)
        return self._unit(slot, k)

    def _fits(self, entry: tuple[int, int, int, int], step_tokens: dict[DocKey, int], cap: int) -> bool:
        slot, k = entry[2], entry[3]
        docs = self._docs
        held = step_tokens.get((self.source, docs[8 * slot + 4], docs[8 * slot + 5]), 0)
        if not held:
            return True
        start, stop = self._span(slot, k)
        return held + stop - start <= cap

    def _span(self, slot: int, k: int) -> tuple[int, int]:
        length, flags = self._docs[8 * slot + 1], self._docs[8 * slot + 7]
        if flags & ~_UINT16:  # a conversation or a sample with images: one unit
            return 0, length
        return unit_span(length, self._seq_len, self._bucket_rows, k)

    def _unit(self, slot: int, k: int) -> Unit:
        """Make the unit from the store, and let its document go when it was the last."""
        handle, length, left, _, group, pos, ordinal, flags = self._docs[8 * slot : 8 * slot + 8]
        dtype = _ID_DTYPES[flags & _UINT16]
        if flags & ~_UINT16:
            unit = self._whole_unit(handle, length, ordinal, (group, pos), flags, dtype)
        elif length <= self._seq_len:  # most units: a whole document of text (chunk_unit's first case)
            tokens = np.frombuffer(self._store.read(handle, 0, length * dtype.itemsize), dtype)
            unit = (Segment(self.source, sample_id(self.source, ordinal, 0), length, tokens, origin=(group, pos)),)
        else:
            start, stop = unit_span(length, self._seq_len, self._bucket_rows, k)
            data = self._store.read(handle, start * dtype.itemsize, (stop - start) * dtype.itemsize)
            tokens = np.frombuffer(data, dtype)
            unit = chunk_unit(self.source, ordinal, (group, pos), tokens, k, self._seq_len, self._bucket_rows)
        self._store.release(handle)
        docs = self._docs
        docs[8 * slot + 2] = left - 1
        if left == 1:  # its slot is reused once no older document waits (the queue holds slots)
            oldest = self._oldest
            while oldest and docs[8 * oldest[0] + 2] == 0:
                self._free.append(oldest.popleft())
        return unit

    def _whole_unit(
        self, handle: int, length: int, ordinal: int, origin: tuple[int, int], flags: int, dtype: np.dtype
    ) -> Unit:
        """A conversation's or an image sample's one unit, from all its arrays."""
        images = flags >> 8
        size = length * dtype.itemsize
        mask_size = length if flags & _MASKED else 0
        pixel_size = 0
        if images:
            if self._image_hw is None:
                raise ValueError("a spread of samples with images needs their image_hw")
            pixel_size = images * 3 * self._image_hw[0] * self._image_hw[1]
        data = self._store.read(handle, 0, size + mask_size + 4 * images + pixel_size)
        tokens = np.frombuffer(data, dtype, length)
        mask = np.frombuffer(data, np.uint8, length, size) if mask_size else None
        image_at = pixels = None
        if images and self._image_hw is not None:
            image_at = np.frombuffer(data, np.int32, images, size + mask_size)
            pixels = np.frombuffer(data, np.uint8, pixel_size, size + mask_size + 4 * images)
            pixels = pixels.reshape(images, 3, *self._image_hw)
        doc = Doc(self.source, ordinal, tokens, *origin, image_at, pixels, mask=mask)
        return units_of(doc, self._seq_len, self._bucket_rows, self._rows)[0]

    # -- position --------------------------------------------------------------------------
    def position(self, cursor: tuple[int, int]) -> SpreadPosition:
        """Where the spread stands; `cursor`: the source's next document (right after the last added)."""
        if self._oldest:
            at = 8 * self._oldest[0]
            start, clock = (self._docs[at + 4], self._docs[at + 5]), self._docs[at + 3]
        else:
            start, clock = cursor, self.clock
        passed = tuple(sorted(self._passed))
        return SpreadPosition(
            start, clock, self.horizon, self.fill, self.frontier, passed, self.ended, self.drawn_since_end
        )


class MemoryStore:
    """A UnitStore in this process's memory, for tests and tools that plan small runs; the
    coordinator keeps waiting documents on local disk (coordinator/spill.py)."""

    def __init__(self) -> None:
        self._held: dict[int, list[Any]] = {}  # handle -> [bytes, units left]
        self._next = 0

    def put(self, parts: Sequence[np.ndarray], units: int) -> int:
        handle, self._next = self._next, self._next + 1
        self._held[handle] = [b"".join(np.ascontiguousarray(p).view(np.uint8).ravel().data for p in parts), units]
        return handle

    def read(self, handle: int, offset: int, size: int) -> memoryview:
        return memoryview(self._held[handle][0])[offset : offset + size]

    def release(self, handle: int) -> None:
        held = self._held[handle]
        held[1] -= 1
        if not held[1]:
            del self._held[handle]

    @property
    def held_bytes(self) -> int:
        return sum(len(data) for data, _ in self._held.values())
