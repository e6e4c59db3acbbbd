"""The step arena's space: FIFO by step, never split at the wrap, full is None."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from omniload.coordinator.serve.arena import FifoSpace


def test_steps_take_in_order_and_wrap_without_splitting_a_payload():
    space = FifoSpace(100)
    assert space.take(0, 40) == 0
    assert space.take(0, 40) == 40
    assert space.take(1, 30) is None, "only 20 bytes left before the wrap and none after it"
    space.release_through(0)
    assert space.take(1, 30) == 0, "a payload that does not fit before the end starts at 0"
    assert space.used == 50  # the 20 skipped bytes count until step 1 is let go
    space.release_through(1)
    assert space.used == 0


def test_a_payload_larger_than_the_space_never_fits():
    assert FifoSpace(10).take(0, 11) is None


@given(
    st.lists(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=4), min_size=1, max_size=30),
    st.integers(min_value=0, max_value=4),
)
def test_live_payloads_never_overlap(steps, lag):
    """Whatever the sizes, the bytes of steps not yet let go are disjoint and inside the space."""
    space, live = FifoSpace(128), {}
    for step, sizes in enumerate(steps):
        for size in sizes:
            offset = space.take(step, size)
            if offset is None:
                continue
            assert 0 <= offset and offset + size <= 128
            live.setdefault(step, []).append((offset, size))
        spans = sorted((o, o + n) for s in live for o, n in live[s] if n)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
        if step >= lag:
            space.release_through(step - lag)
            live = {s: v for s, v in live.items() if s > step - lag}
