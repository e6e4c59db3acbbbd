"""One TCP connection to the coordinator: a rank's session or a control session.

A connection says HELLO with the job's token within `_HANDSHAKE_S`, then either
- a rank: STARTING (HELLO) -> SERVING (ACKs, each returning a credit; BYE when it stops on
  purpose) -> CLOSED; or
- a control client (`omniload mix`, `omniload status`): MIX requests, each answered with the
  step it applies at, and STATUS requests, answered with the job's figures.

A peer that breaks the protocol (bad bytes, wrong token, an ACK for a step it was never sent)
is answered with ERROR and its connection closed; nothing else is disturbed. Everything else
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

from omniload.errors import OmniloadError, ProtocolError
from omniload.protocol import FrameDecoder, Hello, Kind, Message, encode, read_hello, read_step, read_wait

from omniload.coordinator.delivery import RankState

log = logging.getLogger("omniload")
_HANDSHAKE_S = 10.0
_READ_CHUNK = 64 * 1024
_MAX_HANDSHAKES = 1024  # connections that have not said HELLO yet; more are closed at once


class Refused(Exception):
    """The coordinator will not serve this connection; the message goes to the peer."""


class Hub(Protocol):
    token: bytes

    async def admit(self, hello: Hello, writer: asyncio.StreamWriter) -> RankState: ...
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
        peer = writer.get_extra_info("peername")
        _nodelay(writer)
        try:
            inbox = _Inbox(reader)
            hello = await self._handshake(inbox)
            if hello is None:
                return
            if hello.role == "control":
                await self._control(inbox, writer)
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

    async def _handshake(self, inbox: _Inbox) -> Hello | None:
        """The peer's checked HELLO; None if it hung up first."""
        if self._handshakes >= _MAX_HANDSHAKES:
            raise Refused(f"too many connections are opening at once (over {_MAX_HANDSHAKES}); try again")
        self._handshakes += 1
        try:
            async with asyncio.timeout(_HANDSHAKE_S):
                first = await inbox.next()
        finally:
            self._handshakes -= 1
        if first is None:
            return None
        hello = read_hello(first)
        if not hmac.compare_digest(hello.token.encode(), self._hub.token):
            raise Refused("authentication failed: wrong OMNILOAD_TOKEN")
        return hello

    async def _rank(self, hello: Hello, inbox: _Inbox, writer: asyncio.StreamWriter) -> None:
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

    async def _control(self, inbox: _Inbox, writer: asyncio.StreamWriter) -> None:
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


def _say(writer: asyncio.StreamWriter, kind: Kind, **header: Any) -> None:
    if not writer.is_closing():
        writer.write(encode(Message(kind, header)))


class _Inbox:
    """Messages from one peer's stream, decoded by the sans-I/O FrameDecoder."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._decoder = FrameDecoder()
        self._queued: deque[Message] = deque()

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


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
