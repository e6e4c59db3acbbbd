"""How planned steps reach the ranks' sockets: their frames, the senders and the step arena.

Each step is encoded once per kind of rank (`encode_step`, pure: it may run on the planner's
thread); each frame carries the loader position after the step, which the rank's
state_dict() returns. Where senders serve (--senders; Linux; those the job's first rank or relay
keeps, see serve/sender_pool.py), a frame's payload is copied into
the step arena, a shared-memory segment the sender processes read, allocated on a thread once
the first step says how large steps are; the steps before it is ready, and any it has no room
for, go over the senders' sockets. Without senders the coordinator's own connections write
the frames (serve/sessions.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Sequence

from omniload.batch_arrays import expand, narrow, trained_tokens
from omniload.coordinator.plan.parallel import CP_SPLITTERS
from omniload.coordinator.plan.stepper import Step
from omniload.coordinator.pool.worker_pool import available_cpus
from omniload.coordinator.serve.arena import StepArena
from omniload.coordinator.serve.batch_frames import encode_batch, step_fields
from omniload.coordinator.serve.delivery import Frame, Frames, Variant
from omniload.coordinator.serve.listening import bind
from omniload.coordinator.serve.sender_pool import Accepting, SenderPool
from omniload.coordinator.serve.sessions import Sessions
from omniload.errors import ConfigError
from omniload.formats.ring import segment_path
from omniload.spec import Spec

log = logging.getLogger("omniload")
_ARENA_CAPACITY = 4 << 30  # the step arena's address space; the part a job's steps need is allocated
_ARENA_MIN = 16 << 20
_CAN_SEND = hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")  # senders need Linux
# --senders -1 keeps one sender per this many connecting ranks (at most one per 8 cores): below
# it the loop's own writes keep up (bench_fanout: 16 and 32 lean ranks pulling flat out got 25M
# token slots/s on 2 cores with or without a sender), and each sender is a ~24 MB process
_RANKS_PER_SENDER = 64


class Dispatch:
    def __init__(
        self,
        spec: Spec,
        job_id: str,
        source_names: list[str],
        fail: Callable[[str, BaseException], None],
        token: bytes,
    ) -> None:
        self._spec, self._job_id, self._source_names, self._fail = spec, job_id, source_names, fail
        self._token = token
        self.sender_pool: SenderPool | None = None
        self._arena: StepArena | None = None  # the planned steps' payloads, for the senders
        self._arena_sized = False
        self._placing = True  # frames go into the arena (while senders serve)

    def spawn(self) -> None:
        """Start the senders (--senders; by default one per 8 CPUs on Linux, of which the first
        rank's world keeps one per _RANKS_PER_SENDER connecting ranks). Before the loop."""
        count = self._spec.senders if self._spec.senders >= 0 else available_cpus() // 8 if _CAN_SEND else 0
        if not count:
            return
        if not _CAN_SEND:
            raise ConfigError("--senders needs Linux (pidfd_open and SCM_RIGHTS); use --senders 0 here")
        self._arena = StepArena(segment_path(os.getpid(), self._job_id, "arena"), _ARENA_CAPACITY)
        senders = SenderPool(count, self._arena.path, self._fail, self._token, self.size_senders)
        senders.spawn()
        log.info("%d senders write batches to the ranks", count)
        self.sender_pool = senders

    def size_senders(self, world: int | None) -> int:
        """How many of the senders to keep for a world of `world` ranks (None: the ranks come
        through relays, whose streams the loop serves), and with none, stop placing frames in
        the step arena. Called on the loop at the first rank's or relay's HELLO, before any
        step is planned."""
        if self._spec.senders >= 0:
            return self._spec.senders
        # with --broadcast-at tp only each tensor-parallel group's first rank connects (Layout.connects)
        connecting = 0 if world is None else world // self._spec.tp if self._spec.broadcast_at == "tp" else world
        keep = connecting // _RANKS_PER_SENDER
        if keep == 0:  # the arena stays until the job ends, empty: a retired sender may still be opening it
            self._placing = False
        return keep

    async def listen(
        self, sessions: Sessions, host: str, port: int, reserved: socket.socket | None = None
    ) -> asyncio.Server | Accepting:
        """The rank port (`reserved`: already bound, a standby's): accepted by the senders where
        they serve, else by this loop."""
        listener = bind(host, port, "--port", reserved)
        if self.sender_pool is not None:
            await self.sender_pool.start(sessions.session)
            return self.sender_pool.listen(listener, sessions.session)
        return await asyncio.start_server(sessions.serve, sock=listener)

    def encode_step(self, step: Step, position: dict, dp: int, frame_kinds: Sequence[Variant]) -> Frames:
        """One frame for each kind of rank (pure: it may run on a thread); each carries the
        loader position after the step, which the rank's state_dict() returns."""
        shared = step_fields(
            {
                "dp": dp,
                "imbalance": round(step.balance["imbalance"], 4),
                "to_bound": round(step.balance["to_bound"], 4),
                # the loss's denominator: sum of token losses / this, times dp (docs/planning.md)
                "global_trained_tokens": trained_tokens(step.batches),
                "weights": dict(zip(self._source_names, step.weights)),
                # per-step diversity (plan/diversity.py): distinct documents, each source's top share
                "documents": step.balance["documents"],
                "top_doc_share": dict(zip(self._source_names, step.balance["top_doc_share"])),
                "state": position,
            }
        )
        frames, full_rows, split = {}, {}, CP_SPLITTERS[self._spec.cp_split]
        for variant in frame_kinds:
            dp_rank, cp_rank, has_data = variant
            fields = {"tokens": step.tokens[dp_rank], "compact": has_data and self._spec.cp == 1}
            if not has_data:
                arrays = {}
            elif self._spec.cp == 1:
                arrays = step.batches[dp_rank]
            else:  # a slice's labels and positions need the whole row or sequence: sent, as int32
                if dp_rank not in full_rows:  # once per replica, whatever the number of its cp ranks
                    full_rows[dp_rank] = split.prepare(expand(step.batches[dp_rank]), self._spec.cp)
                arrays = narrow(split.take(full_rows[dp_rank], self._spec.cp, cp_rank))
            frames[variant] = self._place(step.number, *encode_batch(step.number, arrays, fields, shared))
        return frames

    def planned(self, frames: Frames) -> None:
        """A step was planned (on the loop): the first one sizes the step arena."""
        if self._arena is not None and self._placing and not self._arena_sized:
            self._reserve_arena(frames)

    def release_through(self, step: int) -> None:
        """Every rank has read the steps up to `step`: their bytes in the arena are free."""
        if self._arena is not None:
            self._arena.release_through(step)

    async def stop(self) -> None:
        if self.sender_pool is not None:
            await self.sender_pool.stop()

    def close(self) -> None:
        """Kill the senders and unlink the arena; always, from the coordinator's `finally`."""
        if self.sender_pool is not None:
            self.sender_pool.kill()
        if self._arena is not None:
            self._arena.close()

    def _place(self, number: int, head: bytes, payload: bytes) -> Frame:
        """A frame, its payload copied into the step arena where senders serve and it has room
        (thread-safe: encoding may run on the planner's thread)."""
        arena = self._arena if self._placing else None
        placed = arena.put(number, payload) if arena is not None else None
        return (head, *placed) if placed else (head, payload, None)

    def _reserve_arena(self, frames: Frames) -> None:
        """Allocate the step arena on a thread, sized by the first step; the steps before it is
        ready go over the senders' sockets."""
        arena, self._arena_sized = self._arena, True
        assert arena is not None  # made with the senders
        need = max(_ARENA_MIN, sum(len(payload) for _, payload, _ in frames.values()) * (self._spec.plan_ahead + 4) * 2)

        def reserved(done: asyncio.Future) -> None:
            if done.exception() is not None:
                log.warning(
                    "senders get batches over their sockets: no room for a %d MB step arena in /dev/shm (%s)",
                    need >> 20,
                    done.exception(),
                )
                self._arena = None
                arena.close()

        asyncio.get_running_loop().run_in_executor(None, arena.reserve, need).add_done_callback(reserved)
