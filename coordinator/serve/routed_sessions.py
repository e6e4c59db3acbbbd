"""The coordinator's end of a relay's connection: one session per rank behind the relay.

The relay's pieces (omniload.route) go to each local connection's own frame decoder. A
connection's first piece starts its session (`Sessions.session`, exactly as for a direct
connection), and what the session writes goes back as ROUTE pieces. When the relay's
connection ends, every session behind it ends as if its own connection had.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from omniload.errors import ProtocolError
from omniload.protocol import FrameDecoder, Message
from omniload.route import CLOSE, EOF, OPEN, Piece, RouteReader, route_head, route_ref

ROUTE_PIECE = 64 * 1024  # the most bytes of a rank's stream in one relay -> coordinator ROUTE
READ_CHUNK = 256 * 1024


class Writer(Protocol):
    """What a session writes to: an asyncio.StreamWriter, or a RoutedWriter behind a relay."""

    def write(self, data: bytes | memoryview) -> None: ...
    def is_closing(self) -> bool: ...
    def can_write_eof(self) -> bool: ...
    def write_eof(self) -> None: ...
    def close(self) -> None: ...


class Inbox(Protocol):
    async def next(self) -> Message | None: ...


Session = Callable[[Inbox, Writer, str], Coroutine[Any, Any, None]]


class RouteOut:
    """The one connection many routed writers share. Their pieces are gathered and written
    once per loop iteration: a step's frames for a thousand ranks behind a relay or a sender
    take one writev, not a thousand."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._pending: list[bytes | memoryview] = []

    def send(self, *parts: bytes | memoryview) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self._pending += parts

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self.writer.is_closing():
            self.writer.writelines(pending)

    def is_closing(self) -> bool:
        return self.writer.is_closing()


class RoutedWriter:
    """One rank's side of a shared connection: each write goes out as one ROUTE piece."""

    def __init__(self, out: RouteOut, conn: int, via: str, refs: bool = False) -> None:
        self._out, self._conn = out, conn
        self.via = via  # the relay or sender that carries this connection, for `omniload status`
        self.refs = refs  # the far end reads the step arena: payloads there go as references
        self._closed = self._eof = False

    def write(self, data: bytes | memoryview) -> None:
        if not self.is_closing() and not self._eof:
            self._out.send(route_head(self._conn, len(data)), data)

    def write_ref(self, head: bytes, ref: tuple[int, int]) -> None:
        """A frame whose payload is in the step arena: the head, then a reference to the payload."""
        if not self.is_closing() and not self._eof:
            self._out.send(route_head(self._conn, len(head)), head, route_ref(self._conn, *ref))

    def is_closing(self) -> bool:
        return self._closed or self._out.is_closing()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if not self.is_closing() and not self._eof:
            self._eof = True
            self._out.send(route_head(self._conn, 0, EOF))

    def close(self) -> None:
        if not self.is_closing():
            self._out.send(route_head(self._conn, 0, CLOSE))
        self._closed = True


def send_frame(writer: Writer, head: bytes, payload: bytes | memoryview, ref: tuple[int, int] | None) -> None:
    """Write one frame, its payload by reference where the writer's far end reads the arena."""
    write_ref = getattr(writer, "write_ref", None) if getattr(writer, "refs", False) else None
    if ref is not None and write_ref is not None:
        write_ref(head, ref)
    else:
        writer.write(head)
        writer.write(payload)


class RoutedInbox:
    """One rank's messages, fed by the relay connection's reader."""

    def __init__(self) -> None:
        self._decoder = FrameDecoder()
        self._queue: asyncio.Queue[Message | BaseException | None] = asyncio.Queue()

    def feed(self, data: bytes | memoryview) -> None:
        try:
            for message in self._decoder.feed(data):
                self._queue.put_nowait(message)
        except ProtocolError as exc:  # this rank's problem, raised in its own session
            self._queue.put_nowait(exc)

    def end(self) -> None:
        if self._decoder.pending:
            self._queue.put_nowait(
                ProtocolError(f"connection closed inside a frame ({self._decoder.pending} bytes pending)")
            )
        self._queue.put_nowait(None)

    async def next(self) -> Message | None:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class RoutedSessions:
    """The sessions behind one shared connection, fed with its pieces."""

    def __init__(self, out: RouteOut, session: Session, peer: str, refs: bool = False) -> None:
        """`peer` names the shared connection: "relay HOST:PORT" or "sender N (pid P)"."""
        self.out, self._session, self._peer, self._refs = out, session, peer, refs
        self._inboxes: dict[int, RoutedInbox] = {}
        self._tasks: set[asyncio.Task] = set()
        self._expected: dict[int, bytes] = {}  # handed to a sender, not yet opened: the bytes already read

    @property
    def live(self) -> int:
        """Connections assigned here and not ended (counted from the handoff on)."""
        return len(self._tasks) + len(self._expected)

    def expect(self, conn: int, first: bytes) -> None:
        """A connection was handed to the far end; its session opens when the far end says OPEN."""
        self._expected[conn] = first

    def forget(self, conn: int) -> bool:
        """The far end never took an expected connection; False if it has opened meanwhile."""
        return self._expected.pop(conn, None) is not None

    def _open(self, conn: int) -> None:
        if conn in self._inboxes:
            raise ProtocolError(f"connection {conn} opened twice on {self._peer}")
        first = self._expected.pop(conn, b"")
        inbox = self._inboxes[conn] = RoutedInbox()
        task = asyncio.create_task(
            self._session(
                inbox, RoutedWriter(self.out, conn, self._peer, self._refs), f"{self._peer} (connection {conn})"
            )
        )
        self._tasks.add(task)

        def ended(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            self._inboxes.pop(conn, None)

        task.add_done_callback(ended)
        if first:
            inbox.feed(first)

    def feed(self, piece: Piece) -> None:
        if piece.event == OPEN:
            self._open(piece.conn)
            return
        inbox = self._inboxes.get(piece.conn)
        if inbox is None:
            return  # its session ended (e.g. refused); the far end has not heard yet
        if piece.event in (EOF, CLOSE):
            inbox.end()  # a rank's half-close ends its stream, as on a direct connection
            self._inboxes.pop(piece.conn, None)
        elif piece.ref is not None:
            raise ProtocolError(
                f"{self._peer} sent an arena reference; only the coordinator sends them: "
                "run the same omniload version everywhere"
            )
        else:
            inbox.feed(piece.data)

    async def end(self) -> None:
        """The shared connection is gone: every session behind it ends, as if its own had."""
        for inbox in self._inboxes.values():
            inbox.end()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.out.flush()


async def read_routes(reader: asyncio.StreamReader, sessions: RoutedSessions, max_piece: int) -> None:
    """Feed the shared connection's pieces to its sessions until it ends; then end them."""
    routes = RouteReader(max_piece)
    try:
        while data := await reader.read(READ_CHUNK):
            for piece in routes.feed(data):
                sessions.feed(piece)
    finally:
        await sessions.end()


async def serve_relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str, session: Session) -> None:
    """Run the sessions of every rank behind the relay until its connection ends."""
    await read_routes(reader, RoutedSessions(RouteOut(writer), session, peer), ROUTE_PIECE)
