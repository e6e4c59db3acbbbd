"""The planner over in-memory sources: as far as allowed, mixture changes at an exact step
boundary even while a step waits for slow records, costly computations moved off the loop,
and a clean stop mid-wait."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from omniload.coordinator.plan_task import Offloader, PlanTask
from omniload.errors import OmniloadError
from tests.unit.test_stepper import ListIntake, _spec, _stepper, heavy_tailed

pytestmark = pytest.mark.timeout(60)
NEW = {"s0": 0.0, "s1": 0.0, "s2": 1.0}


class SlowIntake(ListIntake):
    """A source whose records trickle in: often none is there yet when the planner asks."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._asked = 0

    def poll(self, until_group=None):
        self._asked += 1
        return super().poll(until_group) if self._asked % 4 == 0 else None


async def _plan(stepper, allowed: int, change_after_steps: int | None = None):
    """Plan `allowed` steps; once `change_after_steps` of them have arrived, change the weights."""
    steps: asyncio.Queue = asyncio.Queue()
    planner = PlanTask(
        stepper,
        "f",
        lambda step, position: step.weights,
        lambda number, weights, position, tokens: steps.put_nowait((number, weights)),
        lambda count: steps.put_nowait(None),
    )
    task = planner.start(allowed)
    got, at = [], None
    for arrived in range(allowed + 1):
        if arrived == change_after_steps:
            at = await planner.change_weights(NEW)
        if arrived < allowed:
            got.append(await asyncio.wait_for(steps.get(), 30))
    await asyncio.sleep(0.05)  # time to go past what was allowed, were it to
    assert steps.empty(), "the planner went past what was allowed"
    await planner.stop()
    assert task.cancelled() or task.exception() is None
    return got, at, planner


def test_a_change_applies_from_exactly_the_step_it_names_even_mid_step():
    stepper = _stepper(_spec(), intakes=[SlowIntake(i, heavy_tailed(i, 1500)) for i in range(3)])
    got, at, _ = asyncio.run(_plan(stepper, allowed=12, change_after_steps=1))
    assert 0 < at < 12, "the change came while steps were being planned"
    for number, weights in got:
        assert (weights == [0.0, 0.0, 1.0]) == (number >= at), (number, at, weights)


def test_a_change_while_held_by_the_slowest_rank_names_the_next_step():
    got, at, planner = asyncio.run(_plan(_stepper(_spec()), allowed=3, change_after_steps=3))
    assert at == 3 and [n for n, _ in got] == [0, 1, 2]
    assert planner.progress()["steps"] == 3


def test_stop_ends_a_wait_for_records_and_later_changes_say_why():
    asked = threading.Event()

    class Dry(ListIntake):
        def poll(self, until_group=None):
            asked.set()
            return None  # a source that never delivers (its worker is stuck)

    stepper = _stepper(_spec(), intakes=[Dry(i, [10]) for i in range(3)])

    async def go():
        planner = PlanTask(stepper, "f", lambda s, p: None, lambda *a: None, lambda *a: None)
        planner.start(4)
        while not asked.is_set():  # the planner waits for a record that never comes
            await asyncio.sleep(0.01)
        await asyncio.wait_for(planner.stop(), 30)  # (a stop that did not end the wait would hang here)
        with pytest.raises(OmniloadError, match="stopping"):
            await planner.change_weights(NEW)

    asyncio.run(go())


def _busy() -> int:
    """10 ms of CPU (sleeping would not count: the offloader weighs CPU time)."""
    started = time.thread_time()
    while time.thread_time() - started < 0.01:
        pass
    return threading.get_ident()


def test_quick_computations_stay_on_the_loop_and_slow_ones_move_to_a_thread():
    async def go():
        offloader, loop_thread = Offloader(), threading.get_ident()
        quick = [await offloader.run("quick", threading.get_ident) for _ in range(5)]
        slow = [await offloader.run("slow", _busy) for _ in range(5)]
        return loop_thread, quick, slow

    loop_thread, quick, slow = asyncio.run(go())
    assert quick == [loop_thread] * 5
    assert slow[0] == loop_thread and all(t != loop_thread for t in slow[1:]), "after one slow run, a thread"
