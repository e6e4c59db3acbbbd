"""The planner thread: plans and encodes steps off the event loop, as far as the ranks allow.

Planning a step waits for records and takes milliseconds (tens at DP=1024), and encoding the
ranks' frames copies every token, so none of it runs on the loop that serves the ranks. The
thread owns the stepper; the loop talks to it through three verbs (`allow`, `change_weights`,
`stop`) and gets finished steps, the end of the data and failures back through
`call_soon_threadsafe`.

Lifecycle: CREATED -> PLANNING (start) -> ENDED (the data ended) | STOPPED (stop) | FAILED.
A live mixture change is applied by the thread between two steps, so the step it names in
its reply is exactly the first step planned with the new weights.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from omniload.errors import OmniloadError

from omniload.coordinator.stepper import Cancelled, Step, Stepper

log = logging.getLogger("omniload")
_STOP_S = 10.0

StepHandler = Callable[[int, Any, dict, int], None]  # (step number, frames, position after it, real tokens)


class PlannerThread:
    def __init__(self, stepper: Stepper, fingerprint: str, encode: Callable[[Step, dict], Any],
                 loop: asyncio.AbstractEventLoop, on_step: StepHandler, on_end: Callable[[int], None],
                 on_error: Callable[[str, BaseException], None]) -> None:
        self._stepper, self._fingerprint, self._encode = stepper, fingerprint, encode
        self._loop = loop
        self._on_step, self._on_end, self._on_error = on_step, on_end, on_error
        self._wake = threading.Condition()
        self._allowed = 0  # may plan the steps numbered below this
        self._changes: list[tuple[dict[str, float], concurrent.futures.Future]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._over: str | None = None  # why no more changes can be applied, once the thread ended
        self._steps, self._seconds, self._last_step_s = 0, 0.0, 0.0
        self._last: dict = {}  # the last step's figures (balance, weights, carry)

    def start(self, allowed: int) -> None:
        self._allowed = allowed
        self._thread = threading.Thread(target=self._run, name="omniload-planner", daemon=True)
        self._thread.start()

    def allow(self, until: int) -> None:
        """Let the thread plan the steps numbered below `until` (the slowest rank moved)."""
        with self._wake:
            if until > self._allowed:
                self._allowed = until
                self._wake.notify()

    def change_weights(self, weights: dict[str, float]) -> concurrent.futures.Future:
        """A future of the step the new weights take effect at. Before start, the change is
        applied at once (the loop owns the stepper until then)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._over:
                future.set_exception(OmniloadError(self._over))
            elif self._thread is None:
                future.set_result(self._stepper.change_weights(weights))
            else:
                self._changes.append((weights, future))
                self._wake.notify()
        return future

    def stop(self) -> None:
        """End the thread, even mid-wait for a record; bounded by _STOP_S."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._stepper.cancel.set()
        if self._thread is not None:
            self._thread.join(_STOP_S)
            if self._thread.is_alive():
                log.warning("the planner thread did not stop in %.0fs", _STOP_S)
        self._finish("the job is stopping")

    def _run(self) -> None:
        stepper = self._stepper
        try:
            while self._next_boundary():
                started = time.perf_counter()
                step = stepper.next_step()
                if step is None:
                    self._finish(f"the data ended after {stepper.step} steps")
                    self._to_loop(self._on_end, stepper.step)
                    return
                position = stepper.export_state(self._fingerprint)
                frames = self._encode(step, position)
                self._count(step, time.perf_counter() - started)
                self._to_loop(self._on_step, step.number, frames, position, sum(step.tokens))
        except Cancelled:
            pass
        except BaseException as exc:  # reported by the loop's one failure path
            self._finish(f"the planner failed: {exc}")
            self._to_loop(self._on_error, "the planner", exc)

    def _next_boundary(self) -> bool:
        """Wait between two steps until one may be planned; apply the mixture changes that came
        meanwhile. False when stopping."""
        while True:
            with self._wake:
                while not self._stopping and not self._changes and self._stepper.step >= self._allowed:
                    self._wake.wait()
                if self._stopping:
                    return False
                changes, self._changes = self._changes, []
                ready = self._stepper.step < self._allowed
            for weights, future in changes:
                future.set_result(self._stepper.change_weights(weights))
            if ready:
                return True

    def figures(self) -> dict:
        """What the planner has done: steps, time per step (waiting for records included), and
        the last step's balance, carry-over and weights. Read from any thread."""
        mean = self._seconds / self._steps if self._steps else 0.0
        return {"steps": self._steps, "ms_per_step": round(1000 * mean, 2),
                "last_ms": round(1000 * self._last_step_s, 2), **self._last}

    def _count(self, step: Step, seconds: float) -> None:
        self._steps += 1
        self._seconds += seconds
        self._last_step_s = seconds
        plan = step.figures
        self._last = {"imbalance": round(plan.get("imbalance", 1.0), 4), "max_cost": plan.get("max_cost", 0.0),
                      "mean_cost": plan.get("mean_cost", 0.0), "carry": plan.get("carried", 0),
                      "weights": [round(w, 4) for w in step.weights]}

    def _finish(self, why: str) -> None:
        with self._wake:
            self._over = self._over or why
            changes, self._changes = self._changes, []
        for _, future in changes:
            future.set_exception(OmniloadError(why))

    def _to_loop(self, callback: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed: the job is over and nobody waits for this
            pass
