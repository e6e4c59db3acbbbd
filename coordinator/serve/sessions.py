"""One TCP connection to the coordinator: a rank's session or a control session.

A connection says HELLO with the job's token within `HANDSHAKE_S`, then either
- a rank: STARTING (HELLO) -> SERVING (ACKs, each returning a credit; BYE when it stops on
  purpose) -> CLOSED; or
- a control client (`omniload mix`, `omniload status`): MIX requests, each answered with the
  step it applies at, and STATUS requests, answered with the job's figures.

A peer that breaks the protocol (bad bytes, wrong token, an ACK for a step it was never sent)
is answered with ERROR and its connection closed; nothing else is disturbed. A relay's
connection carries many such sessions, one per rank behind it (routed_sessions.py). Everything else
that goes wrong here is a bug, handed to the coordinator's one failure path (`Hub.fail`).
The coordinator (`Hub`) decides what a HELLO, an ACK or a MIX means.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from collections import deque
from typing import Any, Protocol

import orjson

from omniload.coordinator.serve.delivery import RankState
from omniload.coordinator.serve.routed_sessions import Inbox, Writer, serve_relay
from omniload.errors import OmniloadError, ProtocolError
from omniload.protocol import FrameDecoder, Hello, Kind, Message, encode, read_hello, read_step, read_wait

log = logging.getLogger("omniload")
HANDSHAKE_S = 10.0
_READ_CHUNK = 64 * 1024
MAX_HANDSHAKES = 1024  # connections that have not said HELLO yet; more are closed at once


class Refused(Exception):
    """The coordinator will not serve this connection; the message goes to the peer."""


class Hub(Protocol):
    token: bytes

    async def admit(self, hello: Hello, writer: Writer) -> RankState: ...
    def acknowledge(self, state: RankState, step: int) -> None: ...
    def rank_gone(self, state: RankState) -> None: ...
    async def change_weights(self, weights: Any) -> int: ...
    def status(self) -> dict[str, Any]: ...
    def fail(self, where: str, exc: BaseException) -> None: ...


class Sessions:
    """The `client_connected_cb` of the coordinator's server."""

    def __init__(self, hub: Hub) -> None:
        self._hub = hub
        self._handshakes = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        await self.session(StreamInbox(reader), writer, peer_name(writer.get_extra_info("peername")))

    async def session(self, inbox: Inbox, writer: Writer, peer: str) -> None:
        """One peer from HELLO to the end: a direct connection, or a rank behind a relay."""
        try:
            hello = await self._handshake(inbox)
            if hello is None:
                return
            if hello.role == "control":
                await self._control(inbox, writer)
            elif hello.role == "relay" and isinstance(inbox, StreamInbox) and isinstance(writer, asyncio.StreamWriter):
                # only a direct connection can carry a relay: its writer is the socket's own
                _say(writer, Kind.WELCOME, role="relay")
                await serve_relay(inbox.raw_reader(), writer, f"relay {peer}", self.session)
            elif hello.role == "relay":
                raise ProtocolError("a relay cannot connect through a relay")
            else:
                await self._rank(hello, inbox, writer)
        except Refused as exc:
            log.warning("refused a connection from %s: %s", peer, exc)
            _say(writer, Kind.ERROR, message=str(exc))
        except (ProtocolError, TimeoutError) as exc:
            log.warning("dropped a connection from %s: %s", peer, exc or "no HELLO in time")
            _say(writer, Kind.ERROR, message=f"protocol error: {exc or 'no HELLO in time'}")
        except (ConnectionError, asyncio.CancelledError):
            pass  # the peer is gone, or the coordinator is shutting down: end the session quietly
        except Exception as exc:  # a bug: the job stops, and every rank (this one too) is told why
            self._hub.fail(f"the session of {peer}", exc)
        finally:
            writer.close()

    async def _handshake(self, inbox: Inbox) -> Hello | None:
        """The peer's checked HELLO; None if it hung up first."""
        if self._handshakes >= MAX_HANDSHAKES:
            raise Refused(f"too many connections are opening at once (over {MAX_HANDSHAKES}); try again")
        self._handshakes += 1
        try:
            async with asyncio.timeout(HANDSHAKE_S):
                first = await inbox.next()
        finally:
            self._handshakes -= 1
        if first is None:
            return None
        hello = read_hello(first)
        if not hmac.compare_digest(hello.token.encode(), self._hub.token):
            raise Refused("authentication failed: wrong OMNILOAD_TOKEN")
        return hello

    async def _rank(self, hello: Hello, inbox: Inbox, writer: Writer) -> None:
        state = await self._hub.admit(hello, writer)
        try:
            while (message := await inbox.next()) is not None:
                if message.kind is Kind.ACK:
                    self._hub.acknowledge(state, read_step(message))
                    state.wait_s = read_wait(message) or state.wait_s
                elif message.kind is Kind.BYE:
                    state.said_bye = True
                else:
                    raise ProtocolError(f"unexpected {message.kind.name} from rank {state.rank}")
        finally:
            self._hub.rank_gone(state)

    async def _control(self, inbox: Inbox, writer: Writer) -> None:
        while (message := await inbox.next()) is not None:
            if message.kind is Kind.STATUS:
                writer.write(encode(Message(Kind.STATUS, {}, orjson.dumps(self._hub.status()))))
                continue
            if message.kind is not Kind.MIX:
                raise ProtocolError(f"unexpected {message.kind.name} on a control connection")
            weights = message.header.get("weights")
            try:
                step = await self._hub.change_weights(weights)
            except OmniloadError as exc:  # bad weights, or no step left to change: the client's answer
                _say(writer, Kind.ERROR, message=str(exc))
                continue
            _say(writer, Kind.MIX, step=step, weights=weights)


def _say(writer: Writer, kind: Kind, **header: Any) -> None:
    if not writer.is_closing():
        writer.write(encode(Message(kind, header)))


class StreamInbox:
    """Messages from one peer's stream, decoded by the sans-I/O FrameDecoder."""

    def __init__(self, reader: asyncio.StreamReader, first: bytes = b"") -> None:
        """`first`: bytes of the stream already read (a HELLO read before a sender took over)."""
        self._reader = reader
        self._decoder = FrameDecoder()
        self._queued: deque[Message] = deque(self._decoder.feed(first))

    async def next(self) -> Message | None:
        """The next message, or None at end of stream."""
        while not self._queued:
            data = await self._reader.read(_READ_CHUNK)
            if not data:
                if self._decoder.pending:
                    raise ProtocolError(f"connection closed inside a frame ({self._decoder.pending} bytes pending)")
                return None
            self._queued.extend(self._decoder.feed(data))
        return self._queued.popleft()

    def raw_reader(self) -> asyncio.StreamReader:
        """The stream itself, for a connection that stops speaking whole frames (a relay's)."""
        if self._queued or self._decoder.pending:
            raise ProtocolError("a relay sent data before the coordinator's WELCOME")
        return self._reader


def peer_name(address: object) -> str:
    """HOST:PORT of a TCP peer (whatever else, as it prints)."""
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
