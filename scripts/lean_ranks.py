"""Many ranks in one process that read their batches without decoding them: the fan-out
benchmark's consumer when the coordinator, not its clients, is what is measured.

Each rank is one socket: HELLO and WELCOME as a rank client does (omniload.rank_link), then
every BATCH frame is read into one scratch buffer, its header parsed for the step and the
input_ids shape, and acknowledged at once. No tensors, no threads: one `selectors` loop over
all the sockets, so two cores can pull batches faster than a coordinator sends them.
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import Any

from omniload.protocol import PREFIX, Kind, Message, encode, parse_header, parse_prefix
from omniload.rank_link import Link

_MAX_HEADER, _MAX_PAYLOAD = 16 << 20, 1 << 40
_SCRATCH = bytearray(8 << 20)


class _Rank:
    """One connection's reading state: the prefix, then the header, then the payload."""

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank, self.sock = rank, sock
        self.prefix = bytearray()
        self.header = bytearray()
        self.kind: Kind | None = None
        self.header_left = self.payload_left = 0
        self.arrivals: list[float] = []
        self.slots = self.received = 0
        self.done = False

    def readable(self) -> None:
        """Read what is there; acknowledge each BATCH as soon as its last byte is in."""
        while True:
            try:
                if self.kind is None:
                    got = self.sock.recv(PREFIX.size - len(self.prefix))
                    if not got:
                        raise ConnectionError(f"rank {self.rank}: the coordinator closed the connection")
                    self.prefix += got
                    self.received += len(got)
                    if len(self.prefix) < PREFIX.size:
                        continue
                    self.kind, self.header_left, self.payload_left = parse_prefix(
                        self.prefix, _MAX_HEADER, _MAX_PAYLOAD
                    )
                    self.prefix.clear()
                elif self.header_left:
                    got = self.sock.recv(self.header_left)
                    if not got:
                        raise ConnectionError(f"rank {self.rank}: the coordinator closed the connection")
                    self.header += got
                    self.header_left -= len(got)
                    self.received += len(got)
                elif self.payload_left:
                    got_n = self.sock.recv_into(_SCRATCH, min(self.payload_left, len(_SCRATCH)))
                    if not got_n:
                        raise ConnectionError(f"rank {self.rank}: the coordinator closed the connection")
                    self.payload_left -= got_n
                    self.received += got_n
                if self.kind is not None and not self.header_left and not self.payload_left:
                    self._frame_done()
                    if self.done:
                        return
            except BlockingIOError:
                return

    def _frame_done(self) -> None:
        header: dict[str, Any] = parse_header(bytes(self.header)) if self.header else {}
        kind, self.kind = self.kind, None
        self.header.clear()
        if kind is Kind.BATCH:
            self.arrivals.append(time.time())
            shape = next(t["shape"] for t in header["tensors"] if t["name"] == "input_ids")
            self.slots += shape[0] * shape[1]
            self.sock.sendall(encode(Message(Kind.ACK, {"step": header["step"], "wait": 0.0})))
        elif kind is Kind.END:
            self.done = True
        elif kind is Kind.ERROR:
            raise RuntimeError(f"rank {self.rank}: the coordinator says {header.get('message')}")


def consume(addrs: dict[int, str], token: str, world: int, prefetch: int = 2) -> list[dict[str, Any]]:
    """Connect every rank of `addrs` and read until each has its END; per rank the arrival
    times of its batches and the token slots they held."""
    selector = selectors.DefaultSelector()
    ranks = []
    for rank, addr in addrs.items():
        hello = {"token": token, "rank": rank, "world_size": world, "credits": prefetch}
        link, _ = Link.greet(addr, hello, min_epoch=0, keepalive=False, page_locked=None)
        link.sock.setblocking(False)
        ranks.append(_Rank(rank, link.sock))
        selector.register(link.sock, selectors.EVENT_READ, ranks[-1])
    live = len(ranks)
    while live:
        for key, _ in selector.select(timeout=60):
            state: _Rank = key.data
            state.readable()
            if state.done:
                selector.unregister(state.sock)
                state.sock.close()
                live -= 1
    return [{"rank": r.rank, "arrivals": r.arrivals, "slots": r.slots, "received": r.received} for r in ranks]
