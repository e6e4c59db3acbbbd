"""The rank <-> coordinator wire protocol, sans I/O: bytes in, messages out.

A frame is a 16-byte prefix, an orjson header and raw payload bytes:

    magic b"OL" | version u8 | kind u8 | header length u32 | payload length u64 | header | payload

Rank -> coordinator: HELLO (token, rank, world size, initial credit), ACK (a consumed step,
which also returns one credit), BYE (the rank stops on purpose). A control client (`omniload
mix`) sends HELLO with role "control", then MIX (new weights), answered by MIX (the step
they take effect at), or STATUS, answered by STATUS (the job's figures as a JSON payload).
Coordinator -> rank: WELCOME, BATCH (tensor layout in the
header, tensor bytes in the payload), WAIT (why no batch comes: the rank the job waits for),
END, ERROR. Either side may send ERROR and close. A relay (`omniload relay`) sends HELLO with
role "relay", is answered by WELCOME, and then carries its node's ranks' streams, untouched,
in ROUTE frames (omniload.route).

Failover (coordinator/ha/following.py): a WELCOME names the serving coordinator, "pid", "host",
"role" ("primary", or "promoted" for a standby that took over) and "epoch" (its lease's; 0
without a checkpoint folder). A rank never accepts a WELCOME of a lower epoch than one it was
served by, and the epoch changes only with the connection, so frames carry none. An ERROR
with "fenced": true means the coordinator lost its lease: the rank goes on at another address.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import orjson

from omniload.errors import ProtocolError

VERSION = 2  # 2: WAIT
MAGIC = b"OL"
PREFIX = struct.Struct("<2sBBIQ")
MAX_CONTROL_HEADER = 64 * 1024


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    BATCH = 3
    ACK = 4
    END = 5
    ERROR = 6
    BYE = 7
    MIX = 8  # control client -> coordinator: new weights; coordinator -> control client: applied
    WAIT = 9  # coordinator -> rank: a note on what the job waits for while no batch comes
    STATUS = 10  # control client -> coordinator: asks; coordinator -> client: the figures, JSON payload
    ROUTE = 11  # relay <-> coordinator: a piece of one local rank's stream (omniload.route)


Payload = bytes | bytearray | memoryview  # sent as is: a big payload is never copied into the frame


@dataclass(slots=True)
class Message:
    kind: Kind
    header: dict[str, Any] = field(default_factory=dict)
    payload: Payload = b""


def encode_parts(kind: Kind, header: dict[str, Any], payload: Payload = b"") -> tuple[bytes, Payload]:
    """Prefix+header as one bytes object and the payload untouched, so big payloads are not copied."""
    return encode_raw(kind, orjson.dumps(header), payload)


def encode_raw(kind: Kind, head: bytes, payload: Payload = b"") -> tuple[bytes, Payload]:
    """Like encode_parts, with the header already encoded as a JSON object."""
    return PREFIX.pack(MAGIC, VERSION, kind, len(head), len(payload)) + head, payload


def encode(msg: Message) -> bytes:
    head, payload = encode_parts(msg.kind, msg.header, msg.payload)
    return head + bytes(payload)


def parse_prefix(data: bytes | bytearray | memoryview, max_header: int, max_payload: int) -> tuple[Kind, int, int]:
    """Validate a 16-byte prefix; return (kind, header length, payload length)."""
    magic, version, kind, header_len, payload_len = PREFIX.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"not an omniload frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this side speaks {VERSION}): "
            "install the same omniload version on the ranks and the coordinator"
        )
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if header_len > max_header:
        raise ProtocolError(f"frame header of {header_len} bytes exceeds the limit of {max_header}")
    if payload_len > max_payload:
        raise ProtocolError(f"frame payload of {payload_len} bytes exceeds the limit of {max_payload}")
    return kind, header_len, payload_len


def parse_header(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        header = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"frame header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame header must be a JSON object")
    return header


class FrameDecoder:
    """Incremental decoder: feed any split of the byte stream, get whole messages back."""

    def __init__(self, max_header: int = MAX_CONTROL_HEADER, max_payload: int = 0) -> None:
        self._buf = bytearray()
        self._max_header = max_header
        self._max_payload = max_payload

    def feed(self, data: bytes | memoryview) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while len(self._buf) >= PREFIX.size:
            kind, hlen, plen = parse_prefix(self._buf[: PREFIX.size], self._max_header, self._max_payload)
            end = PREFIX.size + hlen + plen
            if len(self._buf) < end:
                break
            header = parse_header(self._buf[PREFIX.size : PREFIX.size + hlen])
            payload = bytes(self._buf[PREFIX.size + hlen : end])
            del self._buf[:end]
            out.append(Message(kind, header, payload))
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)


@dataclass(frozen=True, slots=True)
class Hello:
    """A HELLO's fields, checked: a peer's bad field is a ProtocolError, never a crash."""

    token: str
    role: str  # "rank", "control" or "relay"
    rank: int = 0
    world_size: int = 0
    credits: int = 1
    resume: dict[str, Any] | None = None


def read_hello(message: Message) -> Hello:
    if message.kind is not Kind.HELLO:
        raise ProtocolError(f"expected HELLO, got {message.kind.name}")
    header = message.header
    token, role = header.get("token"), header.get("role", "rank")
    if not isinstance(token, str) or role not in ("rank", "control", "relay"):
        raise ProtocolError("HELLO needs a string token and the role 'rank', 'control' or 'relay'")
    if role != "rank":
        return Hello(token, role)
    rank, world, credits = header.get("rank"), header.get("world_size"), header.get("credits", 1)
    if not (_is_int(rank) and _is_int(world) and _is_int(credits)):
        raise ProtocolError(
            f"HELLO: rank, world_size and credits must be integers, got {rank!r}, {world!r}, {credits!r}"
        )
    if not 0 <= rank < world:
        raise ProtocolError(f"HELLO: rank {rank} is not in a world of {world} ranks")
    resume = header.get("resume")
    if resume is not None and not isinstance(resume, dict):
        raise ProtocolError("HELLO: resume must be a loader state (a mapping)")
    return Hello(token, role, rank, world, max(1, credits), resume)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def read_wait(message: Message) -> float | None:
    """The seconds a rank says it has waited for batches so far (an ACK's optional field)."""
    wait = message.header.get("wait")
    return float(wait) if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait >= 0 else None


def read_step(message: Message) -> int:
    """The step an ACK or BYE names (BYE may name none: -1)."""
    step = message.header.get("step", -1 if message.kind is Kind.BYE else None)
    if step is None and message.kind is Kind.BYE:
        return -1
    if not isinstance(step, int) or isinstance(step, bool):
        raise ProtocolError(f"{message.kind.name}: step must be an integer, got {step!r}")
    return step
