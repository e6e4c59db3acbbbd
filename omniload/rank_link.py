"""One rank's connection to a coordinator (or to its node's relay): the HELLO/WELCOME
handshake, then whole frames. Which address to use, and when to go to another, is the
Loader's business (omniload.client); this module only speaks the protocol on one socket.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch

from omniload.errors import OmniloadError, ProtocolError
from omniload.protocol import PREFIX, Kind, Message, encode, parse_header, parse_prefix

_CONNECT_S = 30.0
# With standbys, a primary whose host died (no FIN, no RST) must still be noticed: TCP
# keepalive probes after 5 s of silence, every 2 s, give up after 3 (about 11 s)
_KEEPALIVE = (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3))
_MAX_HEADER = 16 << 20
_MAX_PAYLOAD = 1 << 40

Frame = tuple[Kind, dict[str, Any], "bytearray | torch.Tensor"]


class Unreachable(OmniloadError):
    """No coordinator to go on with at this address (not listening, gone, or of an older epoch)."""


class Refused(OmniloadError):
    """A coordinator answered HELLO with ERROR; its message says why."""


class ReceiveFailed(OmniloadError):
    """Receiving failed on this side (not the connection); its message says how."""


def open_connection(addr: str) -> socket.socket:
    """A connected socket to HOST:PORT (the coordinator) or unix:PATH (the node's relay)."""
    if addr.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(_CONNECT_S)
        try:
            sock.connect(addr[len("unix:") :])
        except OSError:
            sock.close()
            raise
        return sock
    host, _, port = addr.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=_CONNECT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Link:
    """A handshaken connection. `page_locked`, when given, allocates the buffer each BATCH
    payload is read into (page-locked memory for pin_memory), so a batch is never copied."""

    def __init__(self, sock: socket.socket, rank: int, page_locked: Callable[[int], torch.Tensor] | None) -> None:
        self.sock, self.rank, self._page_locked = sock, rank, page_locked

    @classmethod
    def greet(
        cls,
        addr: str,
        hello: dict[str, Any],
        *,
        min_epoch: int,
        keepalive: bool,
        page_locked: Callable[[int], torch.Tensor] | None,
    ) -> tuple[Link, dict[str, Any]]:
        """Connect to `addr`, say HELLO and return the link with the WELCOME's header.
        Unreachable: nobody to talk to there (or a coordinator of an epoch older than
        `min_epoch`); Refused: the coordinator said no."""
        rank = hello["rank"]
        try:
            sock = open_connection(addr)
        except (OSError, ValueError) as exc:
            where = "the node's relay" if addr.startswith("unix:") else "the coordinator"
            advice = "; is `omniload relay` running on this node?" if addr.startswith("unix:") else ""
            raise Unreachable(f"cannot reach {where} at {addr}: {exc}{advice}") from None
        if keepalive and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in _KEEPALIVE:
                if hasattr(socket, option):  # Linux names; others keep the system's timing
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        link = cls(sock, rank, page_locked)
        try:
            sock.sendall(encode(Message(Kind.HELLO, hello)))
            kind, header, _ = link.receive_frame()
            if kind is Kind.ERROR:
                raise Refused(f"coordinator at {addr} refused rank {rank}: {header.get('message')}")
            if kind is not Kind.WELCOME:
                raise ProtocolError(f"expected WELCOME from {addr}, got {kind.name}")
            if header.get("epoch", 0) < min_epoch:  # an old primary that has not noticed its successor
                raise Unreachable(
                    f"the coordinator at {addr} serves epoch {header.get('epoch')}, older than "
                    f"epoch {min_epoch} this rank was served by"
                )
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return link, header

    def send(self, message: Message) -> None:
        self.sock.sendall(encode(message))

    def hang_up(self, step: int | None) -> None:
        """BYE, then no more writes: the coordinator reads every ACK sent before it sees the end."""
        try:
            self.send(Message(Kind.BYE, {"step": step}))
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()

    def receive_frame(self) -> Frame:
        prefix = self._receive_exactly(PREFIX.size)
        kind, header_len, payload_len = parse_prefix(prefix, _MAX_HEADER, _MAX_PAYLOAD)
        header = parse_header(self._receive_exactly(header_len))
        if self._page_locked is not None and kind is Kind.BATCH:
            return kind, header, self._receive_pinned(payload_len)
        return kind, header, self._receive_exactly(payload_len)

    def _receive_pinned(self, size: int) -> torch.Tensor:
        """The payload read straight into page-locked memory (on the receive thread, no copy)."""
        assert self._page_locked is not None
        try:
            buffer = self._page_locked(size)
        except RuntimeError as exc:
            raise ReceiveFailed(
                f"rank {self.rank}: cannot allocate {size} bytes of page-locked memory for a "
                f"batch (pin_memory=True): {exc}"
            ) from exc
        self._receive_into(buffer.numpy().data)  # ndarray.data: memoryview(array)
        return buffer

    def _receive_exactly(self, size: int) -> bytearray:
        buffer = bytearray(size)
        self._receive_into(memoryview(buffer))
        return buffer

    def _receive_into(self, view: memoryview) -> None:
        while view:
            got = self.sock.recv_into(view)
            if not got:
                raise ConnectionError("the coordinator closed the connection")
            view = view[got:]
