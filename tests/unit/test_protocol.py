import pytest

from omniload.errors import ProtocolError
from omniload.protocol import PREFIX, VERSION, FrameDecoder, Kind, Message, encode, encode_parts, read_hello, read_step

MESSAGES = [
    Message(Kind.HELLO, {"token": "t", "rank": 3, "world_size": 8, "credits": 4}),
    Message(Kind.BATCH, {"step": 7, "tensors": []}, b"\x01\x02" * 50),
    Message(Kind.ACK, {"step": 7}),
    Message(Kind.END, {"steps": 8}),
]


def test_every_split_of_the_stream_decodes_the_same_messages():
    stream = b"".join(encode(m) for m in MESSAGES)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder(max_payload=1 << 20)
        got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert [(m.kind, m.header, bytes(m.payload)) for m in got] == [
            (m.kind, m.header, bytes(m.payload)) for m in MESSAGES
        ], cut
        assert decoder.pending == 0


def test_byte_at_a_time():
    stream = b"".join(encode(m) for m in MESSAGES)
    decoder = FrameDecoder(max_payload=1 << 20)
    got = [m for i in range(len(stream)) for m in decoder.feed(stream[i : i + 1])]
    assert len(got) == len(MESSAGES)


def test_payload_is_not_copied_by_encode_parts():
    payload = memoryview(b"x" * 1000)
    head, body = encode_parts(Kind.BATCH, {"step": 1}, payload)
    assert body is payload and len(head) > PREFIX.size


@pytest.mark.parametrize(
    "garbage, cause",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "not an omniload frame"),
        (PREFIX.pack(b"OL", 99, Kind.HELLO, 2, 0) + b"{}", "version 99"),
        (PREFIX.pack(b"OL", VERSION, 42, 2, 0) + b"{}", "unknown frame kind"),
        (PREFIX.pack(b"OL", VERSION, Kind.HELLO, 1 << 30, 0), "header of 1073741824 bytes"),
        (PREFIX.pack(b"OL", VERSION, Kind.HELLO, 2, 10) + b"{}", "payload of 10 bytes"),
        (PREFIX.pack(b"OL", VERSION, Kind.HELLO, 3, 0) + b"{x}", "not valid JSON"),
        (PREFIX.pack(b"OL", VERSION, Kind.HELLO, 2, 0) + b"[]", "JSON object"),
    ],
)
def test_garbage_is_refused_with_the_reason(garbage, cause):
    with pytest.raises(ProtocolError, match=cause):
        FrameDecoder(max_payload=0).feed(garbage)


@pytest.mark.parametrize(
    "header, cause",
    [
        ({"rank": 0, "world_size": 1}, "string token"),
        ({"token": "t", "role": "admin"}, "role"),
        ({"token": "t", "rank": "0", "world_size": 1}, "must be integers"),
        ({"token": "t", "rank": True, "world_size": 2}, "must be integers"),
        ({"token": "t", "rank": 2, "world_size": 2}, "rank 2 is not in a world of 2"),
        ({"token": "t", "rank": 0, "world_size": 2, "resume": [1]}, "loader state"),
    ],
)
def test_a_bad_hello_is_a_protocol_error_naming_the_field(header, cause):
    with pytest.raises(ProtocolError, match=cause):
        read_hello(Message(Kind.HELLO, header))


def test_a_good_hello_reads_with_defaults():
    hello = read_hello(Message(Kind.HELLO, {"token": "t", "rank": 1, "world_size": 2, "credits": 0}))
    assert (hello.role, hello.rank, hello.world_size, hello.credits, hello.resume) == ("rank", 1, 2, 1, None)
    assert read_hello(Message(Kind.HELLO, {"token": "t", "role": "control"})).role == "control"


def test_steps_must_be_integers():
    assert read_step(Message(Kind.ACK, {"step": 4})) == 4
    assert read_step(Message(Kind.BYE, {"step": None})) == -1
    for bad in ({}, {"step": "4"}, {"step": 4.0}):
        with pytest.raises(ProtocolError, match="step must be an integer"):
            read_step(Message(Kind.ACK, bad))
