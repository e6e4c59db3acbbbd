"""The shared-memory ring with a real producer process."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload.formats.ring import FRAME, RecordTooLarge, Ring, RingCorrupt, segment_path

pytestmark = pytest.mark.timeout(60)
_CAPACITY = 4096


def _payload(i: int) -> bytes:
    # sizes sweep from 0 to well over half the ring, so records wrap at every offset
    size = (i * 397) % 2900
    return hashlib.blake2b(str(i).encode()).digest()[:8] * (size // 8) + bytes(size % 8)


def _produce(path: str, count: int, crash_after: int | None) -> None:
    ring = Ring.attach(path)
    for i in range(count):
        if i == crash_after:
            ring._publish = lambda write: os._exit(3)  # dies after copying, before publishing
        while not ring.try_write(_payload(i)):
            time.sleep(0.0001)


@pytest.fixture
def ring():
    ring = Ring.create(segment_path(os.getpid(), "test", f"ring{time.monotonic_ns()}"), _CAPACITY)
    yield ring
    ring.close()
    ring.unlink()


def _consume(ring: Ring, producer: multiprocessing.Process) -> list[bytes]:
    got = []
    while True:
        data = ring.read()
        if data is not None:
            got.append(data)
        elif not producer.is_alive():  # it may have written its last records since the read above
            if ring.used() == 0:
                return got
        else:
            time.sleep(0.0001)


def test_consumer_sees_every_record_once_in_order_across_wrap_around(ring):
    producer = multiprocessing.get_context("fork").Process(target=_produce, args=(str(ring.path), 500, None))
    producer.start()
    got = _consume(ring, producer)
    producer.join()
    assert producer.exitcode == 0
    assert got == [_payload(i) for i in range(500)]
    assert max(len(g) for g in got) > _CAPACITY // 2


def test_producer_crash_mid_record_leaves_no_partial_record(ring):
    producer = multiprocessing.get_context("fork").Process(target=_produce, args=(str(ring.path), 100, 37))
    producer.start()
    got = _consume(ring, producer)
    producer.join()
    assert producer.exitcode == 3
    assert got == [_payload(i) for i in range(37)]
    ring.reset()  # what the coordinator does before starting a replacement
    assert ring.read() is None and ring.try_write(b"fresh") and ring.read() == b"fresh"


@pytest.mark.parametrize("span", [_CAPACITY, 1024])
def test_newest_names_the_last_record_written_without_taking_any(span):
    """What a moved lane's new worker goes on after: the newest unread record, found across
    wrap-arounds and padding (past a short span), with every record still there for the consumer."""
    ring = Ring.create(segment_path(os.getpid(), "test", f"newest{time.monotonic_ns()}"), _CAPACITY, span)
    try:
        _check_newest(ring)
    finally:
        ring.close()
        ring.unlink()


def _check_newest(ring: Ring) -> None:
    assert ring.newest(8) is None
    for i in range(300):  # wraps the ring many times; at each stop the newest is the last written
        while not ring.try_write(_payload(i)):
            assert ring.read() is not None
        assert ring.newest(16) == _payload(i)[:16]
    unread = []
    while (data := ring.read()) is not None:
        unread.append(data)
    assert unread[-1] == _payload(299) and ring.newest(16) is None


def test_full_ring_refuses_instead_of_dropping(ring):
    written = 0
    while ring.try_write(b"x" * 1000):
        written += 1
    assert written == _CAPACITY // 1008
    assert [len(ring.read()) for _ in range(written)] == [1000] * written
    assert ring.read() is None


def test_record_larger_than_the_ring_is_an_error(ring):
    assert ring.try_write(b"y" * (_CAPACITY - FRAME))
    with pytest.raises(RecordTooLarge, match="does not fit a ring"):
        ring.try_write(b"z" * _CAPACITY)


def _allocated(ring: Ring) -> int:
    return os.stat(ring.path).st_blocks * 512


def test_a_span_keeps_small_records_in_its_first_bytes_and_long_ones_still_fit():
    capacity, span = 1 << 20, 64 << 10
    ring = Ring.create(segment_path(os.getpid(), "test", f"span{time.monotonic_ns()}"), capacity, span)
    try:
        assert _allocated(ring) < capacity // 2  # the span is allocated, the rest is sparse
        producer = multiprocessing.get_context("fork").Process(
            target=_produce, args=(str(ring.path), 3000, None)
        )  # ~4 MB through the ring: many wraps
        producer.start()
        got = _consume(ring, producer)
        producer.join()
        assert producer.exitcode == 0
        assert got == [_payload(i) for i in range(3000)]
        assert _allocated(ring) < capacity // 2, "small records touched the ring past its span"
        long = bytes(range(256)) * ((capacity - 4096) // 256)  # larger than the span: allocated on demand
        for small in (5000, 70_000, 300_000, 8):  # wherever the write position is, an empty ring takes it
            assert ring.try_write(b"a" * small) and ring.read() == b"a" * small
            assert ring.try_write(long) and not ring.try_write(b"b" * 5000)
            assert ring.read() == long and ring.read() is None
        assert _allocated(ring) >= capacity - 4096
    finally:
        ring.close()
        ring.unlink()


def test_many_lanes_share_a_read_ahead_budget_and_a_source_of_several_lanes_keeps_its_ring():
    from omniload.coordinator.pool.worker_pool import MIN_SPAN_MB, RING_BUDGET_MB, ring_span

    mb = 1 << 20
    assert ring_span(4, 4) == 4 * mb  # few lanes: --ring-mb in full, as before
    assert ring_span(4, 16) == RING_BUDGET_MB * mb // 16  # 16 sources x 1 lane: the budget split
    assert ring_span(4, 256) == MIN_SPAN_MB * mb  # never below the floor
    assert ring_span(1, 16) == 1 * mb  # never above --ring-mb, which bounds one record
    assert ring_span(4, 8, source_lanes=4) == 4 * mb  # lanes that take turns: a larger budget split
    assert ring_span(4, 16, source_lanes=4) == 2 * mb
    assert ring_span(4, 64, source_lanes=4) == mb // 2  # 16 sources x 4 lanes: 32 MB in all, not 256
    assert ring_span(4, 256, source_lanes=4) == mb // 2  # never below about a turn
    # the budgets count int32 ids: uint16 ids get as many tokens in half the bytes
    assert ring_span(4, 64, source_lanes=4, id_bytes=2) == mb // 4
    assert ring_span(4, 4, id_bytes=2) == 2 * mb
    assert ring_span(1, 4, id_bytes=2) == 1 * mb  # --ring-mb still bounds it


def test_a_lanes_work_counters_only_grow_and_outlive_a_reset(ring):
    """What the autoscaler reads: CPU time and tokens (cost per token) and busy wall time (to
    grow or shrink the pool), added to by each producer and kept when a restart resets the ring."""
    ring.count_work(2_000_000, 500, 5_000_000)
    ring.reset()
    ring.count_work(1_000_000, 100, 1_000_000)
    assert ring.work() == (0.003, 600, 0.006)


# -- checked records: the torture test -------------------------------------------------------
# Each record is payload i, of a size drawn by hypothesis; the model is the list of records
# written and not yet read. Every read must give the next one, intact.
@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, _CAPACITY // 2 - FRAME), min_size=1, max_size=80),
    reads=st.lists(st.integers(0, 3), min_size=1, max_size=80),
    span=st.sampled_from([_CAPACITY, 1024, 64]),
    restarts=st.sets(st.integers(0, 79), max_size=6),
)
def test_every_record_comes_back_once_in_order_whatever_sizes_offsets_readers_and_writers(sizes, reads, span, restarts):
    """Sizes from 0 to half the ring (wraparound at every offset, past a short span); readers
    slower and faster than the writer; at some records a new reader attaches (a restart from the
    position the ring keeps) and a new writer goes on (a lane moved to another worker)."""
    path = segment_path(os.getpid(), "test", f"torture{time.monotonic_ns()}")
    ring = Ring.create(path, _CAPACITY, span)
    writer, reader = Ring.attach(path), Ring.attach(path)
    pending: list[bytes] = []
    try:
        for i, size in enumerate(sizes):
            record = hashlib.blake2b(str(i).encode()).digest()[:8] * (size // 8) + bytes(size % 8)
            if i in restarts:
                reader.close()
                writer.close()
                reader, writer = Ring.attach(path), Ring.attach(path)
            while not writer.try_write(record):
                assert reader.read() == pending.pop(0)  # full: the reader makes room
            pending.append(record)
            for _ in range(reads[i % len(reads)]):
                data = reader.read()
                assert data == (pending.pop(0) if pending else None)
        while pending:
            assert reader.read() == pending.pop(0)
        assert reader.read() is None
    finally:
        for r in (writer, reader, ring):
            r.close()
        ring.unlink()


def _produce_from(path: str, first: int, ready) -> None:
    ring = Ring.attach(path)
    ready.set()
    i = first
    while True:
        while not ring.try_write(_payload(i)):
            pass  # a spinning writer: a kill lands anywhere in a write
        i += 1


@settings(max_examples=8, deadline=None)
@given(delays=st.lists(st.floats(0.0005, 0.02), min_size=3, max_size=5), seed=st.integers(0, 1000))
def test_a_writer_killed_mid_record_leaves_only_whole_records(delays, seed):
    """SIGKILL the writer at random moments, while a slow or fast reader reads: what was
    published reads back whole and in order, and a reset ring serves the next writer, which goes
    on from the last record read (what the coordinator does with a dead worker's lane)."""
    ring = Ring.create(segment_path(os.getpid(), "test", f"killed{time.monotonic_ns()}"), _CAPACITY)
    try:
        _kill_writers(ring, delays, random.Random(seed))
    finally:
        ring.close()
        ring.unlink()


def _kill_writers(ring: Ring, delays: list[float], rng: random.Random) -> None:
    context = multiprocessing.get_context("fork")
    expected = 0
    for delay in delays:
        ready = context.Event()
        writer = context.Process(target=_produce_from, args=(str(ring.path), expected, ready))
        writer.start()
        assert ready.wait(10)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:  # read while it writes: sometimes slower, sometimes faster
            if (data := ring.read()) is not None:
                assert data == _payload(expected)
                expected += 1
            if rng.random() < 0.3:
                time.sleep(0.0002)
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        while (data := ring.read()) is not None:  # what it published before dying, nothing torn
            assert data == _payload(expected)
            expected += 1
        ring.reset()
    assert expected > 0


def test_a_record_torn_or_read_out_of_place_is_named_never_returned(ring):
    for i in range(3):
        assert ring.try_write(b"record %d " % i * 20)
    data_start = 128  # the segment's header
    with open(ring.path, "r+b") as segment:  # flip a byte of the first record's payload
        segment.seek(data_start + FRAME + 5)
        byte = segment.read(1)
        segment.seek(data_start + FRAME + 5)
        segment.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(RingCorrupt, match=rf"ring {ring.path.name}: record 0 at offset 0 .* fails its digest"):
        ring.read()
    assert ring.corrupt and ring.used() > 0  # nothing taken
    ring.reset()
    assert ring.corrupt is None and ring.try_write(b"fine") and ring.read() == b"fine"
    for i in range(2):
        assert ring.try_write(b"record %d " % i * 20)
    with open(ring.path, "r+b") as segment:  # the read position moved by 8: a reader out of place
        segment.seek(64)
        read = int.from_bytes(segment.read(8), "little")
        segment.seek(64)
        segment.write((read + 8).to_bytes(8, "little"))
    with pytest.raises(RingCorrupt, match="claims .* bytes|is number .* not|fails its digest"):
        ring.read()


def test_a_producer_attaching_to_a_ring_of_another_layout_is_told_so(ring):
    """A worker running other omniload code than its coordinator reads the header elsewhere:
    it stops at attach, naming both layouts, instead of writing where the reader does not look."""
    with open(ring.path, "r+b", buffering=0) as segment:
        segment.seek(96)
        segment.write(b"OLRING\x00\x01")
    with pytest.raises(RingCorrupt, match=r"has layout b'OLRING.*x01', this omniload writes .*x02'.*reinstall"):
        Ring.attach(ring.path)


def _publish_forever(path: str, first: int, second: int) -> None:
    ring = Ring.attach(path)
    while True:
        ring._publish(first)
        ring._publish(second)


def test_a_producer_killed_while_it_publishes_leaves_the_old_or_the_new_write_position(ring):
    """The desynchronised ring: the write position used to be stored a byte at a time (zeroed
    first), so a worker killed inside that store left a torn one and the coordinator read past
    the records into stale bytes. 120 kills at random points of a publishing loop; before the
    fix about one in five left a torn position (34 of 300)."""
    first, second = 0x0102030405060708, 0x1112131415161718
    context = multiprocessing.get_context("fork")
    rng = random.Random(0)
    torn = []
    ring._publish(first)
    for _ in range(120):
        producer = context.Process(target=_publish_forever, args=(str(ring.path), first, second), daemon=True)
        producer.start()
        deadline = time.monotonic() + 10
        while int.from_bytes(ring.path.read_bytes()[:8], "little") != second:  # publishing, not starting
            assert time.monotonic() < deadline and producer.is_alive(), "the producer never published"
        time.sleep(rng.uniform(0.0002, 0.002))
        os.kill(producer.pid, signal.SIGKILL)
        producer.join()
        left = int.from_bytes(ring.path.read_bytes()[:8], "little")  # the header's write position
        ring._publish(first)  # the next producer starts from the old value
        if left not in (first, second):
            torn.append(hex(left))
    assert not torn, f"{len(torn)} of 120 kills left a torn write position: {torn[:5]}"


def test_a_reset_numbers_on_so_a_stale_record_never_passes_for_the_next(ring):
    """Records left in the data area from before a reset (unread, or written but never
    published by a producer that died) carry numbers the consumer will never expect again."""
    for i in range(3):
        assert ring.try_write(b"old %d " % i * 10)
    assert ring.read() == b"old 0 " * 10
    ring.reset()  # two unread records stay in the data area
    assert ring.try_write(b"old 0 " * 10)  # same size as the first: the stale second follows it
    with open(ring.path, "r+b") as segment:  # the write position pushed over the stale record
        segment.seek(0)
        write = int.from_bytes(segment.read(8), "little")
        segment.seek(0)
        segment.write((write * 2).to_bytes(8, "little"))
    assert ring.read() == b"old 0 " * 10
    with pytest.raises(RingCorrupt, match="is number .* not"):
        ring.read()
