"""`omniload relay`: one connection to the coordinator for every rank of a node.

Ranks on the node connect to the relay's Unix socket (`OMNILOAD_ADDR=unix:PATH`) exactly as
they would to the coordinator. The relay forwards their streams byte for byte over its one
TCP connection (omniload.route), so 1,024 GPUs on 128 nodes make 128 connections to the
coordinator, and a batch through a relay is the same bytes as one sent directly.

Lifecycle: CONNECTING (HELLO as role "relay", WELCOME) -> SERVING (local ranks come and go)
-> CLOSED when the coordinator hangs up (every local connection is closed with it), on
SIGTERM/SIGINT, or when the command it runs (`omniload relay ... -- CMD`) exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile

from omniload.coordinator.serve.forwarding import Forwarder
from omniload.errors import OmniloadError, ProtocolError
from omniload.protocol import FrameDecoder, Kind, Message, encode

log = logging.getLogger("omniload")
_CONNECT_S = 30.0
_CHILD_STOP_S = 10.0


def default_socket_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"omniload-relay-{os.getpid()}.sock")


class Relay:
    def __init__(self, addr: str, token: str, path: str) -> None:
        self.addr, self.path = addr, path
        self._token = token
        self._forwarder: Forwarder | None = None
        self._next_conn = 0
        self._upstream: asyncio.StreamWriter | None = None
        self._server: asyncio.AbstractServer | None = None
        self.closed = asyncio.Event()
        self.reason = ""
        self.lost = False  # the connection broke, rather than the coordinator closing it

    async def start(self) -> None:
        """Connect and say HELLO to the coordinator, then listen for the node's ranks."""
        reader, self._upstream = await self._connect()
        await self._handshake(reader, self._upstream)
        self._forwarder = Forwarder(self._upstream)
        _remove_stale_socket(self.path)
        self._server = await asyncio.start_unix_server(self._serve_local, self.path)
        self._forwarding = asyncio.create_task(self._forward_down(reader))
        self._forwarding.add_done_callback(self._ended)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._forwarder is not None:
            self._forwarder.close_all()
        if self._upstream is not None:
            self._upstream.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, _, port = self.addr.rpartition(":")
        try:
            async with asyncio.timeout(_CONNECT_S):
                reader, writer = await asyncio.open_connection(host, int(port))
        except (OSError, ValueError, TimeoutError) as exc:
            raise OmniloadError(f"relay: cannot reach the coordinator at {self.addr}: {exc or 'timed out'}") from None
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def _handshake(self, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter) -> None:
        upstream.write(encode(Message(Kind.HELLO, {"token": self._token, "role": "relay"})))
        decoder = FrameDecoder()
        async with asyncio.timeout(_CONNECT_S):
            while not (messages := decoder.feed(await reader.read(4096) or b"")):
                if reader.at_eof():
                    raise OmniloadError(f"relay: the coordinator at {self.addr} hung up during the handshake")
        reply = messages[0]
        if reply.kind is Kind.ERROR:
            raise OmniloadError(
                f"relay: the coordinator at {self.addr} refused the relay: {reply.header.get('message')}"
            )
        if reply.kind is not Kind.WELCOME or len(messages) > 1 or decoder.pending:
            raise ProtocolError(f"relay: expected one WELCOME from {self.addr}, got {reply.kind.name}")

    def _started(self) -> Forwarder:
        """The forwarder, from start() on."""
        if self._forwarder is None:
            raise RuntimeError("relay: used before start()")
        return self._forwarder

    async def _serve_local(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn, self._next_conn = self._next_conn, self._next_conn + 1
        await self._started().serve_local(conn, reader, writer)

    async def _forward_down(self, reader: asyncio.StreamReader) -> None:
        await self._started().forward_down(reader)
        self.reason = f"the coordinator at {self.addr} closed the connection"

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.lost = True
            self.reason = f"lost the coordinator at {self.addr}: {task.exception()}"
        self._started().close_all()  # the ranks see their connection end, as with a direct one
        self.closed.set()


async def run_relay(addr: str, token: str, path: str, cmd: list[str] | None = None) -> int:
    """Relay until the coordinator hangs up (0) or, with `cmd`, until it exits (its code)."""
    relay = Relay(addr, token, path)
    await relay.start()
    print(f"omniload relay: OMNILOAD_ADDR=unix:{path} for the coordinator at {addr}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        if cmd:
            child = await asyncio.create_subprocess_exec(
                *cmd, env={**os.environ, "OMNILOAD_ADDR": f"unix:{path}", "OMNILOAD_TOKEN": token}
            )
            waiting = asyncio.create_task(child.wait())
            await asyncio.wait([waiting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                child.terminate()
                try:
                    await asyncio.wait_for(waiting, _CHILD_STOP_S)
                except TimeoutError:
                    child.kill()
            code = await child.wait()
            return code if code >= 0 else 128 - code
        await asyncio.wait(
            [asyncio.create_task(relay.closed.wait()), asyncio.create_task(stop.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )
        if not relay.closed.is_set():
            return 130
        print(f"omniload relay: {relay.reason}", file=sys.stderr, flush=True)
        return 1 if relay.lost else 0
    finally:
        await relay.close()


def _remove_stale_socket(path: str) -> None:
    """A socket file left by a dead relay is removed; one a live relay serves is an error."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OmniloadError(f"relay: {path} is served by another relay; pass another --socket")
