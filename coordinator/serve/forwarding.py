"""The far end of routed connections, shared by the relay and the sender processes.

Local rank connections on one side, one ROUTE stream (omniload.route) to the coordinator on
the other: what a rank sends goes up as pieces of its connection, what comes down goes to
the rank untouched, or, for a sender, from the shared step arena where the piece says so.
"""

from __future__ import annotations

import asyncio

from omniload.coordinator.serve.routed_sessions import READ_CHUNK, ROUTE_PIECE
from omniload.errors import ProtocolError
from omniload.route import CLOSE, EOF, OPEN, RouteReader, route_head

_PIECE_FROM_COORDINATOR = 1 << 40  # pieces are the coordinator's own writes: bounded there


class Forwarder:
    def __init__(self, upstream: asyncio.StreamWriter, arena: memoryview | None = None) -> None:
        self._upstream = upstream
        self._arena = arena
        self.locals: dict[int, asyncio.StreamWriter] = {}

    async def serve_local(self, conn: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Say OPEN, then forward one rank's bytes up until it hangs up; then say CLOSE."""
        self.locals[conn] = writer
        upstream = self._upstream
        upstream.write(route_head(conn, 0, OPEN))  # before any other piece: pieces are written in order
        try:
            while data := await reader.read(ROUTE_PIECE):
                upstream.writelines([route_head(conn, len(data)), data])
        except ConnectionError:
            pass
        finally:
            if self.locals.pop(conn, None) is not None and not upstream.is_closing():
                upstream.write(route_head(conn, 0, CLOSE))
            writer.close()

    async def forward_down(self, reader: asyncio.StreamReader) -> None:
        """Deliver the coordinator's pieces to the ranks until it hangs up."""
        routes = RouteReader(_PIECE_FROM_COORDINATOR)
        while data := await reader.read(READ_CHUNK):
            batch: list[bytes | memoryview] = []  # consecutive pieces of one connection: one writev
            batch_conn = -1
            for piece in routes.feed(data):
                if piece.conn != batch_conn or piece.event is not None:
                    self._write(batch_conn, batch)
                    batch, batch_conn = [], piece.conn
                if piece.event is not None:
                    self._event(piece.conn, piece.event)
                elif piece.ref is not None:
                    batch.append(self._from_arena(*piece.ref))
                elif piece.data:
                    batch.append(piece.data)
            self._write(batch_conn, batch)

    def close_all(self) -> None:
        for writer in self.locals.values():
            writer.close()
        self.locals.clear()

    def _write(self, conn: int, parts: list[bytes | memoryview]) -> None:
        local = self.locals.get(conn)
        if parts and local is not None:  # else that rank hung up; the coordinator hears of it in our CLOSE
            local.writelines(parts)

    def _event(self, conn: int, event: str) -> None:
        local = self.locals.get(conn)
        if local is None:
            return
        if event == CLOSE:
            del self.locals[conn]
            local.close()
        elif event == EOF and local.can_write_eof():
            local.write_eof()

    def _from_arena(self, offset: int, length: int) -> memoryview:
        if self._arena is None or offset + length > len(self._arena):
            raise ProtocolError(
                f"a reference to bytes {offset}..{offset + length} of a step arena this end does not have"
            )
        return self._arena[offset : offset + length]
