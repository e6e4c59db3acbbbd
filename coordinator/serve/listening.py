"""The coordinator's listening sockets: bind, listen, and the address a peer reaches them at."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

from omniload.errors import ConfigError


async def listen(serve: Callable, host: str, port: int, flag: str) -> asyncio.Server:
    return await asyncio.start_server(serve, sock=bind(host, port, flag))


def bind(host: str, port: int, flag: str) -> socket.socket:
    """A listening socket on host:port; a ConfigError naming `flag` when it cannot be had."""
    try:
        return socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=4096
        )
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another {flag} (0 picks a free port)"
        ) from None


def free_port(host: str) -> int:
    """A port free now, for a standby to announce before it listens (it binds it at takeover)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def reachable(host: str) -> str:
    return socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "::") else host


class _Listening(Protocol):
    """An asyncio.Server, or the senders' Accepting: what listens on a socket."""

    @property
    def sockets(self) -> Sequence[socket.socket]: ...


def address_of(server: _Listening) -> str:
    host, port = server.sockets[0].getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"
