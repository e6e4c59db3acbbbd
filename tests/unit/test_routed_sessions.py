"""The sessions behind one shared connection (a relay's or a sender's), without sockets."""

from __future__ import annotations

import asyncio

from omniload.coordinator.serve.routed_sessions import RoutedSessions, RouteOut
from omniload.protocol import Kind, Message, encode
from omniload.route import CLOSE, OPEN, Piece


class _Wire:
    """Stands in for the shared connection's StreamWriter."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def writelines(self, parts) -> None:
        self.written += [bytes(p) for p in parts]

    def is_closing(self) -> bool:
        return False


def _run(pieces: list[Piece], expected: dict[int, bytes] | None = None) -> dict[int, list]:
    """Feed pieces; each session records the kinds of the messages it reads until its end."""
    seen: dict[int, list] = {}

    async def session(inbox, writer, peer) -> None:
        conn = int(peer.rsplit(" ", 1)[1].rstrip(")"))
        seen[conn] = []
        while (message := await inbox.next()) is not None:
            seen[conn].append(message.kind)

    async def main() -> None:
        sessions = RoutedSessions(RouteOut(_Wire()), session, "relay test")
        for conn, first in (expected or {}).items():
            sessions.expect(conn, first)
        for piece in pieces:
            sessions.feed(piece)
            await asyncio.sleep(0)
        await sessions.end()
        assert sessions.live == 0

    asyncio.run(main())
    return seen


_HELLO = encode(Message(Kind.HELLO, {"token": "t", "rank": 0, "world_size": 1}))
_ACK = encode(Message(Kind.ACK, {"step": 0}))


def test_connections_that_speak_out_of_the_order_they_opened_in_each_get_their_bytes():
    seen = _run([Piece(0, b"", OPEN), Piece(1, b"", OPEN), Piece(1, _HELLO), Piece(0, _HELLO), Piece(0, _ACK)])
    assert seen == {0: [Kind.HELLO, Kind.ACK], 1: [Kind.HELLO]}


def test_pieces_of_a_connection_that_ended_are_dropped_and_open_nothing():
    seen = _run([Piece(0, b"", OPEN), Piece(0, b"", CLOSE), Piece(0, _ACK), Piece(5, _ACK)])
    assert seen == {0: []}


def test_a_handed_over_connection_opens_with_the_bytes_read_before_the_handoff():
    seen = _run([Piece(3, b"", OPEN), Piece(3, _ACK), Piece(3, b"", CLOSE)], expected={3: _HELLO})
    assert seen == {3: [Kind.HELLO, Kind.ACK]}


def test_a_connection_that_closes_right_after_its_open_ends_its_session():
    seen = _run([Piece(3, b"", OPEN), Piece(3, b"", CLOSE)], expected={3: _HELLO})
    assert seen == {3: [Kind.HELLO]}
