"""The planner thread over in-memory sources: as far as allowed, mixture changes at an exact step
boundary even while a step waits for slow records, and a clean stop mid-wait."""
from __future__ import annotations

import asyncio
import time

import pytest

from omniload.coordinator.planning import PlannerThread
from omniload.errors import OmniloadError
from tests.unit.test_stepper import ListIntake, _spec, _stepper, heavy_tailed

pytestmark = pytest.mark.timeout(60)
NEW = {"s0": 0.0, "s1": 0.0, "s2": 1.0}


class SlowIntake(ListIntake):
    def poll(self, until_group=None):
        time.sleep(0.0005)  # a slow source: a step takes tens of milliseconds to gather
        return super().poll(until_group)


async def _plan(stepper, allowed: int, change_after: float | None = None):
    loop = asyncio.get_running_loop()
    steps: asyncio.Queue = asyncio.Queue()
    errors: list = []
    planner = PlannerThread(stepper, "f", lambda step, position: step.weights, loop,
                            lambda number, weights, position, tokens: steps.put_nowait((number, weights)),
                            lambda count: steps.put_nowait(None), lambda where, exc: errors.append(exc))
    planner.start(allowed)
    at = None
    if change_after is not None:
        await asyncio.sleep(change_after)
        at = await asyncio.wrap_future(planner.change_weights(NEW))
    got = [await asyncio.wait_for(steps.get(), 30) for _ in range(allowed)]
    await asyncio.sleep(0.05)
    assert steps.empty(), "the planner went past what was allowed"
    await loop.run_in_executor(None, planner.stop)
    assert not errors, errors
    return got, at, planner


def test_a_change_applies_from_exactly_the_step_it_names_even_mid_step():
    spec = _spec()
    stepper = _stepper(spec)
    stepper._intakes[:] = [SlowIntake(i, heavy_tailed(i, 1500)) for i in range(3)]
    got, at, _ = asyncio.run(_plan(stepper, allowed=12, change_after=0.15))
    assert 0 < at < 12, "the change came while steps were being planned"
    for number, weights in got:
        assert (weights == [0.0, 0.0, 1.0]) == (number >= at), (number, at, weights)


def test_a_change_while_held_by_the_slowest_rank_names_the_next_step():
    got, at, planner = asyncio.run(_plan(_stepper(_spec()), allowed=3, change_after=0.3))
    assert at == 3 and [n for n, _ in got] == [0, 1, 2]


def test_stop_ends_a_wait_for_records_and_later_changes_say_why():
    class Dry(ListIntake):
        def poll(self, until_group=None):
            return None  # a source that never delivers (its worker is stuck)

    stepper = _stepper(_spec())
    stepper._intakes[:] = [Dry(i, [10]) for i in range(3)]

    async def go():
        planner = PlannerThread(stepper, "f", lambda s, p: None, asyncio.get_running_loop(),
                                lambda *a: None, lambda *a: None, lambda *a: None)
        planner.start(4)
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, planner.stop)
        return planner, time.monotonic() - started

    planner, took = asyncio.run(go())
    assert took < 1.0
    with pytest.raises(OmniloadError, match="stopping"):
        planner.change_weights(NEW).result(1)
