"""The planning loop's driver: the stepper, the position the job starts from, and the planner
task over them (coordinator/plan_task.py).

Before the event loop, `place` puts the stepper at the job's start: step 0, or a checkpoint's
snapshot. On the loop, `replay` plans again (off the loop) the steps from that snapshot to the
last consumed one; `reposition` moves the job to the position the first rank brought, its
workers restarted at the cursors there; `start` runs the planner once the first rank is
admitted, and `allow` lets it plan further as the slowest rank moves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from omniload.coordinator.checkpoint.folder import Recovery
from omniload.coordinator.plan.requests import Cancelled
from omniload.coordinator.plan.spread import UnitStore
from omniload.coordinator.plan.stepper import Step, Stepper
from omniload.coordinator.plan_task import PlanTask, StepHandler
from omniload.coordinator.pool.intake import SourceIntake
from omniload.coordinator.pool.workforce import Workforce
from omniload.spec import Spec

log = logging.getLogger("omniload")


class Planning:
    def __init__(self, spec: Spec, intakes: list[SourceIntake], fingerprint: str, store: UnitStore) -> None:
        self._spec, self._fingerprint = spec, fingerprint
        self.stepper = Stepper(spec, intakes, store=store)
        self.start_position: dict[str, Any] = {}  # the position the job starts from (a resume's, or step 0's)
        self.planner: PlanTask

    def place(self, recovery: Recovery | None) -> None:
        """The stepper at the job's start: a snapshot now (the steps after it replayed once the
        loop runs), or step 0."""
        if recovery:
            self.stepper.load_state_dict({**recovery.state, "live": recovery.state["live"] + recovery.live})
        else:
            self.start_position = self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """The stepper's position now, the job's fingerprint with it."""
        return self.stepper.state_dict(self._fingerprint)

    def plan_with(
        self, encode: Callable[[Step, dict[str, Any]], Any], on_step: StepHandler, on_end: Callable[[int], None]
    ) -> PlanTask:
        """The planner (on the loop): `encode` makes a step's frames, `on_step` and `on_end` get them."""
        self.planner = PlanTask(self.stepper, self._fingerprint, encode, on_step, on_end)
        return self.planner

    async def replay(self, recovery: Recovery, doing: str, fail: Callable[[str, BaseException], None]) -> bool:
        """Plan again the steps from the snapshot to the last consumed one, at the size that
        planned them: planning is a pure function of the position, so they come out the same.
        `doing` says what the replay is for, in its log line."""
        started = time.monotonic()

        def replay() -> dict[str, Any]:
            self.stepper.dp = recovery.dp
            self.stepper.rehydrate()
            for _ in range(recovery.replay):
                self.stepper.next_step(build=False)
            return self.state_dict()

        try:
            self.start_position = await asyncio.get_running_loop().run_in_executor(None, replay)
        except Cancelled:
            return False  # the job is stopping (Ctrl-C, or a failure) before it started
        except Exception as exc:
            fail("the resume", exc)
            return False
        log.warning(
            "%s from %s at step %d, its last consistent step (snapshot of step %d, %d steps replayed in %.2fs)",
            doing,
            self._spec.resume or self._spec.checkpoint_dir,
            recovery.step,
            recovery.state["step"],
            recovery.replay,
            time.monotonic() - started,
        )
        return True

    async def reposition(self, position: dict[str, Any], workforce: Workforce) -> None:
        """Move the job to the loader position the first rank brought, before any step is planned."""
        await workforce.restart_all(lambda: self.stepper.load_state_dict(position))
        self.planner.reapply_early_changes()
        self.start_position = position
        log.warning("resuming at step %d, the loader position the ranks brought", position["step"])

    @property
    def started(self) -> bool:
        return self.planner.task is not None

    def start(self, dp: int, allowed: int, ended: Callable[[asyncio.Task[None]], None]) -> None:
        """Plan with `dp` data-parallel ranks, the steps below `allowed` first; `ended(task)`
        when the planner's task ends."""
        self.stepper.dp = dp
        planning = self.planner.start(allowed=allowed)
        planning.add_done_callback(ended)

    def allow(self, until: int) -> None:
        self.planner.allow(until)

    async def stop(self) -> None:
        await self.planner.stop()
