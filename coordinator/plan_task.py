"""The planner: plans and encodes steps as far as the ranks allow, without holding the loop.

It is a task on the event loop that drives the stepper's requests (coordinator/plan/stepper.py):
a wait for records becomes an `await`, and a pure computation (balancing and building a
step, encoding its frames) runs in place while it is quick and on a thread once it is not
(`Offloader`). At a small data-parallel size a step costs a millisecond or two and the loop
plans it between two ACKs; a thread there would only add the GIL's back-and-forth (measured:
25% fewer tokens/s at dp=2 on 2 cores). At dp=1024 a step costs tens of milliseconds, which
then go to a thread, and the stepper yields between draws, so ranks are served meanwhile.

Lifecycle: CREATED -> PLANNING (start) -> ENDED (the data ended) | STOPPED (stop) | FAILED
(the task's exception, which the coordinator's failure path reports). A live mixture change
is applied between two steps, so the step it names is exactly the first one planned with
the new weights.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from omniload.coordinator.plan.requests import Compute, Requests
from omniload.coordinator.plan.stepper import Step, Stepper
from omniload.errors import OmniloadError

_INLINE_MAX_S = 0.003  # computations of a kind that take longer than this (on average) go to a thread

StepHandler = Callable[[int, Any, dict, int], None]  # (step number, frames, position after it, real tokens)


class Offloader:
    """Runs pure computations in place while those of their kind are quick, on a thread while
    they are not. A moving average of their CPU time decides (the thread's own, so time the
    process spent preempted or waiting for the GIL does not count)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    async def run(self, kind: str, fn: Callable[[], Any]) -> Any:
        def timed() -> tuple[Any, float]:
            started = time.thread_time()
            return fn(), time.thread_time() - started

        if self._seconds.get(kind, 0.0) > _INLINE_MAX_S:
            result, took = await asyncio.get_running_loop().run_in_executor(None, timed)
        else:
            result, took = timed()
        self._seconds[kind] = 0.8 * self._seconds.get(kind, took) + 0.2 * took
        return result


async def drive(requests: Requests, offloader: Offloader) -> Any:
    """Run a step's requests on the event loop: await where it waits, offload costly computations."""
    try:
        request = next(requests)
        while True:
            if isinstance(request, Compute):
                request = requests.send(await offloader.run("step", request.fn))
            else:
                await asyncio.sleep(request)
                request = requests.send(None)
    except StopIteration as done:
        return done.value


class PlanTask:
    def __init__(
        self,
        stepper: Stepper,
        fingerprint: str,
        encode: Callable[[Step, dict], Any],
        on_step: StepHandler,
        on_end: Callable[[int], None],
    ) -> None:
        self._stepper, self._fingerprint, self._encode = stepper, fingerprint, encode
        self._on_step, self._on_end = on_step, on_end
        self._offloader = Offloader()
        self._allowed = 0  # may plan the steps numbered below this
        self._wake = asyncio.Event()
        self._changes: list[tuple[dict[str, float], asyncio.Future]] = []
        self.task: asyncio.Task | None = None
        self._over: str | None = None  # why no more changes can be applied, once planning ended
        self._early: list[dict[str, float]] = []  # changes applied before start, in order
        self._steps, self._seconds, self._last_step_s = 0, 0.0, 0.0
        self._last: dict = {}  # the last step's balance, weights and carry

    def start(self, allowed: int) -> asyncio.Task:
        self._allowed = allowed
        self.task = asyncio.get_running_loop().create_task(self._run())
        return self.task

    def allow(self, until: int) -> None:
        """Let the planner plan the steps numbered below `until` (the slowest rank moved)."""
        if until > self._allowed:
            self._allowed = until
            self._wake.set()

    async def change_weights(self, weights: dict[str, float]) -> int:
        """The step the new weights take effect at. Before start, applied at once."""
        if self._over:
            raise OmniloadError(self._over)
        if self.task is None:
            self._early.append(weights)
            return self._stepper.change_weights(weights)
        future = asyncio.get_running_loop().create_future()
        self._changes.append((weights, future))
        self._wake.set()
        return await future

    def reapply_early_changes(self) -> None:
        """After the stepper moved to a rank's position before start: the changes already
        answered apply from there."""
        for weights in self._early:
            self._stepper.change_weights(weights)

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self._finish("the job is stopping")

    async def _run(self) -> None:
        stepper = self._stepper
        try:
            while await self._next_boundary():
                started = time.perf_counter()
                step = await drive(stepper.step_requests(), self._offloader)
                if step is None:
                    self._finish(
                        f"the data has ended after {stepper.step} steps: there is no later step to apply new weights to"
                    )
                    self._on_end(stepper.step)
                    return
                position = stepper.state_dict(self._fingerprint)
                # awaited within this iteration: the lambda never outlives its step and position
                frames = await self._offloader.run("encode", lambda: self._encode(step, position))  # noqa: B023
                self._count(step, time.perf_counter() - started)
                self._on_step(step.number, frames, position, sum(step.tokens))
        except BaseException as exc:
            self._finish(
                "the job is stopping" if isinstance(exc, asyncio.CancelledError) else f"the planner failed: {exc}"
            )
            raise

    async def _next_boundary(self) -> bool:
        """Wait between two steps until one may be planned, applying the mixture changes that
        came meanwhile. Returns True (the loop ends by cancellation)."""
        while True:
            changes, self._changes = self._changes, []
            for weights, future in changes:
                if not future.done():
                    future.set_result(self._stepper.change_weights(weights))
            if self._stepper.step < self._allowed:
                return True
            self._wake.clear()
            await self._wake.wait()

    def progress(self) -> dict:
        """What the planner has done: steps, time per step (waiting for records included), and
        the last step's balance, carry-over and weights."""
        mean = self._seconds / self._steps if self._steps else 0.0
        return {
            "steps": self._steps,
            "ms_per_step": round(1000 * mean, 2),
            "last_ms": round(1000 * self._last_step_s, 2),
            **self._last,
        }

    def _count(self, step: Step, seconds: float) -> None:
        self._steps += 1
        self._seconds += seconds
        self._last_step_s = seconds
        plan = step.balance
        self._last = {
            "imbalance": round(plan.get("imbalance", 1.0), 4),
            "to_bound": round(plan.get("to_bound", 1.0), 4),
            "max_cost": plan.get("max_cost", 0.0),
            "mean_cost": plan.get("mean_cost", 0.0),
            "carry": plan.get("carried", 0),
            "weights": [round(w, 4) for w in step.weights],
            "documents": plan.get("documents", 0),
            "top_doc_share": plan.get("top_doc_share", []),
        }

    def _finish(self, why: str) -> None:
        self._over = self._over or why
        changes, self._changes = self._changes, []
        for _, future in changes:
            if not future.done():
                future.set_exception(OmniloadError(why))
