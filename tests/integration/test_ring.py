"""The shared-memory ring with a real producer process."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time

import pytest

from omniload.formats.ring import RecordTooLarge, Ring, segment_path

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
    assert ring.try_write(b"y" * (_CAPACITY - 8))
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
