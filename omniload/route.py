"""Many ranks' streams over one connection: the relay's framing, sans I/O.

A relay (`omniload relay`) holds one connection to the coordinator for every rank of its
node. Over it each piece of a rank's stream travels in a ROUTE frame whose header names the
relay's number for that rank's local connection, `{"c": CONN}`, and whose payload is the
piece, untouched. An empty ROUTE with `{"c": CONN, "e": "open"}` comes up before a
connection's first piece (connections open in that order, whatever order their ranks speak
in), and `"eof"` or `"close"` says that side half-closed or closed. Pieces are cut wherever the sender wrote, not
at the inner frames'
bounds, so neither end parses the ranks' frames to route them, and a batch through a relay
is the same bytes as a batch sent directly. Between the coordinator and its own sender
processes, `{"c": CONN, "r": [OFFSET, LENGTH]}` with no payload stands for that many bytes of
the shared step arena (coordinator/serve/arena.py), so a batch's bytes never cross that socket.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from omniload.errors import ProtocolError
from omniload.protocol import MAGIC, PREFIX, VERSION, Kind, parse_header, parse_prefix

OPEN, EOF, CLOSE = "open", "eof", "close"
_EVENTS = (OPEN, EOF, CLOSE)
_MAX_ROUTE_HEADER = 256


def route_head(conn: int, length: int, event: str | None = None) -> bytes:
    """The prefix and header of a ROUTE frame; `length` bytes of payload must follow it."""
    head = orjson.dumps({"c": conn} if event is None else {"c": conn, "e": event})
    return PREFIX.pack(MAGIC, VERSION, Kind.ROUTE, len(head), length) + head


def route_ref(conn: int, offset: int, length: int) -> bytes:
    """A whole ROUTE frame standing for `length` bytes at `offset` of the step arena."""
    head = orjson.dumps({"c": conn, "r": [offset, length]})
    return PREFIX.pack(MAGIC, VERSION, Kind.ROUTE, len(head), 0) + head


@dataclass(slots=True)
class Piece:
    conn: int
    data: bytes | memoryview  # a piece of the connection's stream; empty with an event
    event: str | None = None  # OPEN, EOF or CLOSE
    ref: tuple[int, int] | None = None  # (offset, length) in the step arena, in place of data


class RouteReader:
    """Split a stream of ROUTE frames into pieces per connection, without copying payloads:
    a piece is a view of the bytes fed, valid as long as they are (bytes are immutable)."""

    def __init__(self, max_piece: int) -> None:
        self._max_piece = max_piece
        self._head = bytearray()  # a partly received prefix and header
        self._header_len: int | None = None
        self._conn = 0
        self._kind = Kind.ROUTE
        self._payload_len = 0  # of the frame whose header is being read
        self._left = 0  # payload bytes of the current frame still to come

    def feed(self, data: bytes) -> list[Piece]:
        pieces: list[Piece] = []
        view = memoryview(data)
        while view:
            if self._left:
                piece = view[: self._left]
                pieces.append(Piece(self._conn, piece))
                self._left -= len(piece)
                view = view[len(piece) :]
                continue
            want = PREFIX.size + (self._header_len or 0)
            taken = view[: want - len(self._head)]
            self._head += taken
            view = view[len(taken) :]
            if len(self._head) < want:
                break
            if self._header_len is None:
                self._start_frame()
            else:
                pieces.extend(self._end_header())
        return pieces

    def _start_frame(self) -> None:
        kind, header_len, self._payload_len = parse_prefix(self._head, _MAX_ROUTE_HEADER, self._max_piece)
        if kind not in (Kind.ROUTE, Kind.ERROR):
            raise ProtocolError(f"expected ROUTE frames on a routed connection, got {kind.name}")
        self._kind, self._header_len = kind, header_len

    def _end_header(self) -> list[Piece]:
        header = parse_header(self._head[PREFIX.size :])
        self._head.clear()
        self._header_len = None
        if self._kind is Kind.ERROR:  # the far end refused the whole connection: say why
            raise ProtocolError(f"the far end refused the routed connection: {header.get('message')}")
        conn, event = header.get("c"), header.get("e")
        if not isinstance(conn, int) or isinstance(conn, bool) or conn < 0:
            raise ProtocolError(f"ROUTE: the connection must be a number >= 0, got {conn!r}")
        if event is not None and (event not in _EVENTS or self._payload_len):
            raise ProtocolError(f"ROUTE: event {event!r} is not one of {_EVENTS} with no payload")
        self._conn, self._left = conn, self._payload_len
        ref = header.get("r")
        if ref is not None:
            if self._payload_len or not (
                isinstance(ref, list) and len(ref) == 2 and all(type(v) is int and v >= 0 for v in ref)
            ):
                raise ProtocolError(f"ROUTE: a reference is [offset, length] with no payload, got {ref!r}")
            return [Piece(conn, b"", None, (ref[0], ref[1]))]
        return [Piece(conn, b"", event)] if event is not None else []
