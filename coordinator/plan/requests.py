"""How the planner waits without doing I/O: a step is a generator of requests (see
plan/stepper.py). It yields a float (wait that many seconds for records; 0: let others run) or
a `Compute` (a pure function to evaluate), and is sent back the result. `drive` runs one on the
calling thread; the coordinator runs them on its event loop (coordinator/plan_task.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any


class Cancelled(Exception):
    """The stepper was cancelled while it waited for a record (the job is stopping)."""


@dataclass(frozen=True, slots=True)
class Compute:
    """A request of a step: evaluate `fn()` (pure: it touches no stepper state) and send back the result."""

    fn: Callable[[], Any]


Requests = Generator[float | Compute, Any, Any]  # what a step yields, is sent, and returns


def drive(requests: Requests, cancel: threading.Event) -> Any:
    """Run a step's requests on this thread: sleep where it waits, compute in place."""
    try:
        request = next(requests)
        while True:
            if isinstance(request, Compute):
                request = requests.send(request.fn())
                continue
            if cancel.wait(request) if request else cancel.is_set():
                raise Cancelled()
            request = requests.send(None)
    except StopIteration as done:
        return done.value
