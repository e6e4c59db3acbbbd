"""The coordinator: one asyncio process per job. Its lifecycle and its one failure path.

It reads top to bottom: index sources and fork the worker pool (before the loop) -> replay a
--resume folder (off the loop) -> bind and announce -> serve ranks while the planner plans
ahead of the slowest rank and a tick watches the job -> shut down (stop the planner,
close connections, stop workers, unlink rings). A second Ctrl-C forces the exit.

The parts, one role each: the role this coordinator starts in, primary or standby
(ha/roles.py: a standby announces first, follows the primary's lease and delta log, and takes
over); the lease and its fence (ha/tenure.py: a fenced primary exits with FENCED_EXIT);
positions and checkpoints (checkpoint/positions.py, written on a thread by
checkpoint/folder.py); the workers and their supervision (pool/workforce.py); the planning loop
(planning.py and plan_task.py, a costly step's computation on a thread); the ranks'
admission, ACKs and watch (serve/ranks.py, the Hub of serve/sessions.py); frames, senders and
the step arena (serve/dispatch.py). The loop only waits: nothing here blocks on a disk, a join
or a long computation. Every unexpected error, in any task, thread or callback, ends in `fail`,
which names where it happened and tells every rank.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from omniload.coordinator.checkpoint.folder import Recovery
from omniload.coordinator.checkpoint.positions import Positions
from omniload.coordinator.ha.roles import Primary, Standby
from omniload.coordinator.ha.tenure import Tenure
from omniload.coordinator.loop import run_loop
from omniload.coordinator.observe.figures import Figures
from omniload.coordinator.observe.metrics import serve_metrics
from omniload.coordinator.planning import Planning
from omniload.coordinator.pool.autoscale import initial_plan
from omniload.coordinator.pool.catalog import build_catalog, job_identity
from omniload.coordinator.pool.forkserver import share_tokenizers
from omniload.coordinator.pool.worker_pool import available_cpus
from omniload.coordinator.pool.workforce import Workforce
from omniload.coordinator.serve.dispatch import Dispatch
from omniload.coordinator.serve.listening import address_of, listen
from omniload.coordinator.serve.ranks import Ranks
from omniload.coordinator.serve.sessions import Sessions
from omniload.coordinator.spill import Spill
from omniload.errors import ConfigError, OmniloadError, SourceFailed
from omniload.formats.ring import remove_stale_segments
from omniload.protocol import Kind, Message
from omniload.spec import Spec
from omniload.storage.disk_cache import DiskCache

log = logging.getLogger("omniload")
_TICK_S = 0.5
_LAG_WARN_S = 1.0  # the loop was blocked this long between two ticks: say so, it is a bug
_CONNECT_WARN_S = 60.0


class Coordinator:
    def __init__(
        self,
        spec: Spec,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        announce: Callable[[str, str | None], None] = lambda addr, metrics: print(addr),
        job_id: str | None = None,
        exit_with_parent: bool = False,
        standby: bool = False,
    ) -> None:
        """`announce(addr, metrics_addr)` is called once ranks can connect (metrics_addr: None
        without --metrics-port); a standby (coordinator/ha/following.py) announces the address it
        will listen on once it takes over, as soon as it follows the primary."""
        self.spec = spec
        self.token = token.encode()
        self.host, self.port = host, port
        self.reserved: socket.socket | None = None  # a standby's port, bound from its start (listening.reserve)
        self.announce = announce
        self.job_id = job_id or os.urandom(4).hex()
        self.parent = os.getppid() if exit_with_parent else None
        self.source_names = [s.name for s in spec.sources]
        self.role: Primary | Standby = Standby(self) if standby else Primary(self)  # serves only after taking over
        self.tenure = Tenure(self)
        self.dispatch = Dispatch(spec, self.job_id, self.source_names, self.fail, self.token)
        self.exit_code = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        # made in run, before the loop:
        self.positions: Positions
        self.workforce: Workforce
        self.planning: Planning
        # made in _main, on the loop:
        self.should_exit: asyncio.Event
        self.ranks: Ranks
        self.figures: Figures

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to its end; returns the process exit code. Call with no loop running."""
        for path in remove_stale_segments():
            log.info("removed %s, left by a job that died", path.name)
        spec = self.spec
        if spec.cache_dir:
            for path in DiskCache(spec.cache_dir, spec.cache_limit).sweep():
                log.info("removed %s, left in the cache by a writer that died", path.name)
        plan = initial_plan(spec.weights(), spec.workers, spec.reserve_cpus, available_cpus(), spec.autoscale_every > 0)
        # workers that may run at once (a budget's slots) share each tokenizer; one keeps its own
        share_tokenizers(map(spec.tokenizer_of, spec.sources) if len(plan) > 1 else ())
        catalog = build_catalog(spec)
        self.positions = Positions(self.spec, job_identity(self.spec, catalog), self.fail)
        code = self.role.wait_for_turn()
        if code is not None:
            return code
        recovery = self.role.recover()
        self.workforce = Workforce(self.spec, catalog, plan, self.job_id)
        self.spill = Spill(spec.shuffle_dir)
        try:
            self.planning = Planning(self.spec, self.workforce.read_rings(), self.positions.fingerprint, self.spill)
            self.planning.place(recovery)
            self.workforce.start()
            self.positions.open()
            log.info(
                "job %s: %d sources, %d workers, %d lanes",
                self.job_id,
                len(catalog),
                len(plan),
                sum(self.workforce.pool.lane_counts),
            )
            self.dispatch.spawn()
            run_loop(self._main(recovery))
        finally:
            self.workforce.stop()
            self.spill.close()
            self.dispatch.close()
            self.positions.close()
            self.tenure.release(self.exit_code)  # once the folder holds the last position: standbys leave
        return self.exit_code

    async def _main(self, recovery: Recovery | None) -> None:
        loop = self.loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._on_loop_error)
        self.positions.attach(loop)
        self.should_exit, self.ranks = asyncio.Event(), Ranks(self)
        self._install_signal_handlers(loop)
        self.workforce.supervise(self.fail)
        try:
            await self._serve(recovery)
        finally:
            # on every way out, also before serving (a resume's replay failed, the lease is
            # another's): a worker's replacement under way ends on this loop; after it, the
            # loop's executor is shut down and the replacement would fail there, its error logged
            # in place of the cause
            await self.workforce.close()

    async def _serve(self, recovery: Recovery | None) -> None:
        loop = asyncio.get_running_loop()
        planner = self.planning.plan_with(self.ranks.encode_step, self.ranks.on_step, self.ranks.on_end)
        self.figures = Figures(self.job_id, self.source_names, self.workforce.intakes, self.workforce.pool, planner)
        if recovery and not await self.planning.replay(recovery, self.role.replaying(), self.fail):
            return
        if not await self.role.follow(recovery):
            return
        servers = [await self.dispatch.listen(Sessions(self.ranks), self.host, self.port, self.reserved)]
        if self.spec.metrics_port is not None:
            servers.append(
                await listen(serve_metrics(self.ranks.status), self.host, self.spec.metrics_port, "--metrics-port")
            )
        addr, *metrics = [address_of(server) for server in servers]
        if not await self.role.hold_lease(addr):
            for server in servers:
                server.close()
            return
        if metrics:
            log.warning("metrics at http://%s/metrics", metrics[0])
        self.announce(addr, metrics[0] if metrics else None)
        ticker = loop.create_task(self._tick_loop())
        ticker.add_done_callback(lambda task: self.task_ended(task, "the coordinator's watch"))
        try:
            await self.should_exit.wait()
        finally:
            for server in servers:
                server.close()
            ticker.cancel()
            await self.planning.stop()
            await self.ranks.hang_up()
            await self.dispatch.stop()
            await asyncio.gather(ticker, return_exceptions=True)

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        signals = 0

        def on_signal(signum: int) -> None:
            nonlocal signals
            signals += 1
            if signals > 1:
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                self.workforce.stop()
                os._exit(130)
            log.info("%s: shutting down (again to force)", signal.Signals(signum).name)
            self.exit_code = self.exit_code or 128 + signum
            self.planning.stepper.cancel.set()
            self.should_exit.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)

    # -- the one failure path ---------------------------------------------------------------
    def fail(self, where: str, exc: BaseException) -> None:
        """Stop the job: tell every rank why; exit 2 for bad config or bad data and 1 otherwise. On the loop."""
        expected = isinstance(exc, OmniloadError)
        message = (
            str(exc)
            if expected
            else (
                f"internal error in {where}: {type(exc).__name__}: {exc} "
                "(a bug in omniload; please report it with this log)"
            )
        )
        if self.should_exit.is_set():
            log.warning("while shutting down, %s: %s", where, message)
            return
        log.error("%s", message, exc_info=None if expected else exc)
        bad_input = isinstance(exc, ConfigError) or (isinstance(exc, SourceFailed) and exc.bad_input)
        self.halt(2 if bad_input else 1, {"message": message})

    def halt(self, code: int, error: dict[str, Any], abandon_checkpoints: bool = False) -> None:
        """Stop the job with exit `code`, every rank told `error` (an ERROR's header). On the loop."""
        self.exit_code = code
        self.planning.stepper.cancel.set()  # a resume's replay, on a thread, stops waiting for records
        if abandon_checkpoints:  # fenced: the folder is the new primary's
            self.positions.abandon()
        self.ranks.tell_all(Message(Kind.ERROR, error))
        self.should_exit.set()

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Callbacks and connection handlers that raised: never only logged."""
        self.fail("the event loop", context.get("exception") or RuntimeError(context.get("message")))

    def task_ended(self, task: asyncio.Task, where: str) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.fail(where, exc)

    # -- the watch ---------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        started = due = time.monotonic()
        warned = False
        busy = time.thread_time()
        while True:
            due += _TICK_S
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now, was_busy, busy = time.monotonic(), busy, time.thread_time()
            if now - due > _LAG_WARN_S:
                _say_late(now - due, busy - was_busy)
            due = max(due, now - _TICK_S)
            if self.parent is not None and os.getppid() != self.parent:
                log.error("the launching process is gone; shutting down")
                self.exit_code = 1
                self.should_exit.set()
            delivery = self.ranks.delivery
            if delivery and not warned and now - started > _CONNECT_WARN_S:
                missing = self.ranks.unconnected()
                if missing:
                    log.warning("still waiting for rank(s) %s to connect", missing)
                    warned = True
            self.figures.sample(delivery, now)
            if delivery:
                self.ranks.watch(now)


def _say_late(late: float, cpu: float) -> None:
    """The tick came `late` seconds late, the loop's thread having used `cpu` seconds since the
    last one: its own work blocked it (a bug), or the host gave it no CPU (too busy a host)."""
    if cpu > late / 2:
        log.warning(
            "the event loop was blocked for %.1fs by its own work; ranks waited meanwhile (a bug in "
            "omniload: please report it)",
            late,
        )
    else:
        log.warning(
            "the coordinator got no CPU for %.1fs (it ran %.2fs of it): the host is overloaded; ranks "
            "waited meanwhile. Leave the coordinator a core (fewer --workers, or fewer ranks per host)",
            late,
            cpu,
        )
