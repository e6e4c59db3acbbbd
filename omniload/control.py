"""Talk to a running job: change its mixture (`omniload mix`, `Job.set_weights`) and read its
figures (`omniload status`, `Job.status`, launch's progress line)."""

from __future__ import annotations

import socket
from typing import Any

import orjson

from omniload.errors import ConfigError, OmniloadError
from omniload.protocol import MAX_CONTROL_HEADER, FrameDecoder, Kind, Message, encode

_CONTROL_S = 30.0
_MAX_STATUS = 64 << 20  # a status of thousands of ranks is a few MB


def set_weights(addr: str, token: str, weights: dict[str, float]) -> int:
    """Set source weights from the next step the coordinator plans; returns that step.

    Sources not named keep their current weight. Every change is recorded with its step."""
    return int(_ask(addr, token, Message(Kind.MIX, {"weights": weights})).header["step"])


def job_status(addr: str, token: str, timeout: float = _CONTROL_S) -> dict[str, Any]:
    """The job's figures (see coordinator/observe/figures.py for what they hold)."""
    return orjson.loads(_ask(addr, token, Message(Kind.STATUS), timeout).payload)


def _ask(addr: str, token: str, request: Message, timeout: float = _CONTROL_S) -> Message:
    """One request on a control connection, and its answer. `addr` may list the primary and its
    standbys (OMNILOAD_ADDR of `launch --standby`): the one serving is the one that listens."""
    *others, last = [a.strip() for a in addr.split(",") if a.strip()] or [addr]
    for one in others:
        try:
            return _ask_one(one, token, request, timeout)
        except _Unreachable:
            continue  # a standby (it listens only once it has taken over), or a dead primary
    return _ask_one(last, token, request, timeout)


class _Unreachable(OmniloadError):
    """Nothing listens at this address."""


def _ask_one(addr: str, token: str, request: Message, timeout: float) -> Message:
    host, _, port = addr.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError) as exc:
        raise _Unreachable(f"cannot reach the coordinator at {addr}: {exc}") from None
    with sock:
        sock.sendall(encode(Message(Kind.HELLO, {"token": token, "role": "control"})) + encode(request))
        decoder = FrameDecoder(MAX_CONTROL_HEADER, _MAX_STATUS)
        while True:
            try:
                data = sock.recv(1 << 20)
            except OSError as exc:
                raise OmniloadError(f"no answer from the coordinator at {addr}: {exc}") from None
            if not data:
                raise OmniloadError(f"the coordinator at {addr} closed the connection without an answer")
            for reply in decoder.feed(data):
                if reply.kind is Kind.ERROR:
                    raise ConfigError(f"coordinator at {addr}: {reply.header.get('message')}")
                return reply


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
