"""Change a running job's mixture: `omniload mix` and `Job.set_weights` both use this."""
from __future__ import annotations

import socket

from omniload.errors import ConfigError, OmniloadError
from omniload.protocol import MAX_CONTROL_HEADER, FrameDecoder, Kind, Message, encode

_CONTROL_S = 30.0


def set_weights(addr: str, token: str, weights: dict[str, float]) -> int:
    """Set source weights from the next step the coordinator plans; returns that step.

    Sources not named keep their current weight. Every change is recorded with its step."""
    host, _, port = addr.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=_CONTROL_S)
    except (OSError, ValueError) as exc:
        raise OmniloadError(f"cannot reach the coordinator at {addr}: {exc}") from None
    with sock:
        sock.sendall(encode(Message(Kind.HELLO, {"token": token, "role": "control"})) +
                     encode(Message(Kind.MIX, {"weights": weights})))
        decoder = FrameDecoder(MAX_CONTROL_HEADER, 0)
        while True:
            data = sock.recv(65536)
            if not data:
                raise OmniloadError(f"the coordinator at {addr} closed the connection without an answer")
            for reply in decoder.feed(data):
                if reply.kind is Kind.ERROR:
                    raise ConfigError(f"coordinator at {addr}: {reply.header.get('message')}")
                return int(reply.header["step"])


def parse_weights(text: str) -> dict[str, float]:
    """`web=0.4,books=0.3` -> {"web": 0.4, "books": 0.3}."""
    weights = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--set {text!r}: expected NAME=WEIGHT[,NAME=WEIGHT], got {item!r}") from None
        if not sep:
            raise ConfigError(f"--set {text!r}: expected NAME=WEIGHT[,NAME=WEIGHT], got {item!r}")
    return weights
