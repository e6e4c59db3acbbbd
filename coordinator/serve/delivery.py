"""Planned steps and the ranks they go to: credits, acknowledgements, END.

A rank gets the frames it has credit for; each ACK returns a credit and moves the rank's
consumed count (progress.Progress, O(1)). When the slowest rank moves, the steps every rank
has now consumed are handed to `on_consumed` (the checkpoint) and their frames are dropped.
Runs on the event loop; writing to a socket only queues bytes.

A rank's state: CONNECTED (writer set; batches while it has credit) -> DISCONNECTED (writer
None; it may reconnect and carries on after the last step it acknowledged) and, once every
step is sent, ENDED.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from omniload.coordinator.plan.progress import Progress, Stall, find_stall
from omniload.coordinator.serve.routed_sessions import Writer, send_frame
from omniload.errors import ProtocolError
from omniload.protocol import Kind, Message, encode

Variant = tuple[int, int, bool]  # (dp rank, cp rank, receives data): which frame of each step
# a frame's head, its payload and, where the payload sits in the step arena, (offset, length) there
Frame = tuple[bytes, bytes | memoryview, tuple[int, int] | None]
Frames = dict[Variant, Frame]


@dataclass(slots=True)
class RankState:
    rank: int
    variant: Variant
    sent: int = 0  # steps written to the socket
    credits: int = 0
    writer: Writer | None = None
    ended: bool = False
    said_bye: bool = False  # the rank closed on purpose (else it died or lost the network)
    heard: float = 0.0  # monotonic time of its last ACK, connect or disconnect
    seen: bool = False  # it has connected at least once
    wait_s: float = 0.0  # the rank's own count of seconds it waited for batches (sent in ACKs)
    via: str = ""  # what carries its connection: "" direct, else a relay or a sender (routed_sessions.py)

    @property
    def connection(self) -> str:
        if self.writer is not None:
            return "connected"
        return "said bye" if self.said_bye else "gone" if self.seen else "never"


class Delivery:
    def __init__(self, ranks: dict[int, Variant], start: dict, on_consumed: Callable[[dict], None]) -> None:
        """`ranks`: every rank that connects, with its variant; `start`: the position the job
        starts from; `on_consumed(position)`: called for each step every rank has consumed."""
        step = start["step"]
        now = time.monotonic()
        self.ranks = {rank: RankState(rank, variant, heard=now) for rank, variant in ranks.items()}
        self.progress = Progress(ranks, step)
        self.frames: dict[int, Frames] = {}
        self.positions: dict[int, dict] = {step: start}  # steps consumed -> the loader position then
        self.planned = step
        self.final: int | None = None  # set when the data has ended: the number of steps there are
        self.delivered_tokens = 0  # real tokens of the steps every rank has consumed
        self._tokens: dict[int, int] = {}  # step -> its real tokens, until every rank consumed it
        self._on_consumed = on_consumed

    @property
    def slowest(self) -> int:
        return self.progress.slowest

    def consumed(self, rank: int) -> int:
        return self.progress.consumed[rank]

    def add_step(self, number: int, frames: Frames, position: dict, tokens: int = 0) -> None:
        self.frames[number] = frames
        self._tokens[number] = tokens
        self.positions[number + 1] = position
        self.planned = number + 1
        for state in self.ranks.values():
            self.pump(state)

    def end(self, steps: int) -> None:
        self.final = steps
        for state in self.ranks.values():
            self.pump(state)

    def attach(self, rank: int, writer: Writer, credits: int, at: int) -> RankState:
        """A rank (re)connects and goes on after `at` steps (>= the slowest: a position kept)."""
        state = self.ranks[rank]
        self.progress.move(rank, at)
        state.writer, state.sent, state.credits = writer, at, credits
        state.via = getattr(writer, "via", "")
        state.ended, state.said_bye, state.heard, state.seen = False, False, time.monotonic(), True
        return state

    def detach(self, state: RankState) -> None:
        state.writer, state.heard = None, time.monotonic()

    def acknowledge(self, state: RankState, step: int) -> None:
        """The rank consumed `step`: a credit back, its count moved, consumed steps let go."""
        consumed = self.progress.consumed[state.rank]
        if not consumed <= step < state.sent:
            raise ProtocolError(
                f"rank {state.rank} acknowledged step {step}, but it was sent steps {consumed} "
                f"to {state.sent - 1} to acknowledge"
            )
        before = self.progress.slowest
        moved = self.progress.move(state.rank, step + 1)
        state.credits += 1
        state.heard = time.monotonic()
        self.pump(state)
        if moved:
            for done in range(before + 1, before + moved + 1):
                self._on_consumed(self.positions[done])
            for number in range(before, before + moved):
                self.delivered_tokens += self._tokens.pop(number, 0)
                self.frames.pop(number, None)
                self.positions.pop(number, None)

    def pump(self, state: RankState) -> None:
        """Send what the rank has credit for; END once it has every step."""
        writer = state.writer
        if writer is None or writer.is_closing():
            return
        while state.credits > 0 and state.sent < self.planned:
            send_frame(writer, *self.frames[state.sent][state.variant])
            state.sent += 1
            state.credits -= 1
        if self.final is not None and state.sent >= self.final and not state.ended:
            writer.write(encode(Message(Kind.END, {"steps": self.final})))
            state.ended = True

    def tell_all(self, message: Message) -> None:
        frame = encode(message)
        for state in self.ranks.values():
            if state.writer is not None and not state.writer.is_closing():
                state.writer.write(frame)

    def finished(self) -> bool:
        """Every rank has been sent END and has hung up."""
        return all(s.ended and s.writer is None for s in self.ranks.values())

    def stall(self, plan_ahead: int, now: float) -> Stall | None:
        """The rank the others wait for, if they wait for one (see progress.find_stall)."""
        heard = {r: s.heard for r, s in self.ranks.items()}
        connection = {r: s.connection for r, s in self.ranks.items()}
        return find_stall(self.progress, self.planned, plan_ahead, heard, connection, now, self.final is not None)
