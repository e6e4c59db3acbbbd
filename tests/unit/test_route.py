"""The relay's framing: pieces per connection, from any split of the stream."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omniload.errors import ProtocolError
from omniload.protocol import Kind, Message, encode
from omniload.route import CLOSE, EOF, RouteReader, route_head, route_ref

_STREAM = (
    route_head(0, 5)
    + b"hello"
    + route_head(1, 0, CLOSE)
    + route_head(2, 3)
    + b"abc"
    + route_head(0, 0, EOF)
    + route_head(0, 2)
    + b"!!"
)


def _joined(pieces) -> list[tuple[int, bytes, str | None]]:
    """Consecutive data pieces of one connection joined: where the stream was cut is not data."""
    out: list[tuple[int, bytes, str | None]] = []
    for piece in pieces:
        if out and piece.event is None and out[-1][0] == piece.conn and out[-1][2] is None:
            out[-1] = (piece.conn, out[-1][1] + bytes(piece.data), None)
        else:
            out.append((piece.conn, bytes(piece.data), piece.event))
    return out


def test_every_split_of_the_stream_gives_the_same_pieces_and_events():
    whole = _joined(RouteReader(100).feed(_STREAM))
    assert whole == [(0, b"hello", None), (1, b"", CLOSE), (2, b"abc", None), (0, b"", EOF), (0, b"!!", None)]
    for cut in range(len(_STREAM) + 1):
        reader = RouteReader(100)
        assert _joined(reader.feed(_STREAM[:cut]) + reader.feed(_STREAM[cut:])) == whole, cut


@given(st.lists(st.integers(min_value=1, max_value=len(_STREAM)), max_size=12))
def test_any_number_of_cuts(cuts):
    reader, pieces, at = RouteReader(100), [], 0
    for cut in sorted(set(cuts)) + [len(_STREAM)]:
        pieces += reader.feed(_STREAM[at:cut])
        at = cut
    assert _joined(pieces) == _joined(RouteReader(100).feed(_STREAM))


def test_payload_pieces_are_views_of_the_bytes_fed_not_copies():
    data = route_head(7, 1000) + bytes(range(250)) * 4
    [piece] = RouteReader(2000).feed(data)
    assert isinstance(piece.data, memoryview) and piece.data.obj is data


@pytest.mark.parametrize(
    "bad, cause",
    [
        (encode(Message(Kind.ACK, {"step": 1})), "expected ROUTE"),
        (route_head(0, 101) + bytes(101), "exceeds the limit"),
        (route_head(-1, 0), "number >= 0"),
        (route_head(0, 3, "later") + b"abc", "not one of"),
    ],
)
def test_a_bad_route_frame_is_a_protocol_error(bad, cause):
    with pytest.raises(ProtocolError, match=cause):
        RouteReader(100).feed(bad)


def test_an_arena_reference_is_a_piece_with_no_data():
    reader = RouteReader(100)
    [piece] = reader.feed(route_ref(3, 4096, 33000))
    assert (piece.conn, bytes(piece.data), piece.event, piece.ref) == (3, b"", None, (4096, 33000))
