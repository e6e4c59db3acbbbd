"""The coordinator's listening sockets: bind, listen, and the address a peer reaches them at."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

from omniload.errors import ConfigError


async def listen(serve: Callable, host: str, port: int, flag: str) -> asyncio.Server:
    return await asyncio.start_server(serve, sock=bind(host, port, flag))


def bind(host: str, port: int, flag: str, reserved: socket.socket | None = None) -> socket.socket:
    """A listening socket on host:port (`reserved`'s, where the port was reserved); a
    ConfigError naming `flag` when it cannot be had."""
    if reserved is not None:
        reserved.listen(_BACKLOG)
        return reserved
    try:
        return socket.create_server((host, port), family=_family(host), backlog=_BACKLOG)
    except OSError as exc:
        raise _unavailable(host, port, flag, exc) from None


def reserve(host: str, port: int, flag: str) -> socket.socket:
    """host:port (0: any free port) bound, not yet listening: a standby holds it from its start
    to its takeover, so that no other process takes the port it announced meanwhile (any
    connect() on the machine may be given a free port as its own). Ranks that try it before
    the takeover are refused, not queued."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        # Linux lets two sockets that both set SO_REUSEADDR bind one port while neither listens,
        # so a free port (0) is reserved without it; a given port may be a dead coordinator's,
        # whose closed connections linger in TIME_WAIT, and needs it (as create_server sets it)
        if port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise _unavailable(host, port, flag, exc) from None
    return sock


_BACKLOG = 4096


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _unavailable(host: str, port: int, flag: str, exc: OSError) -> ConfigError:
    return ConfigError(
        f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another {flag} (0 picks a free port)"
    )


def free_port(host: str) -> int:
    """A port free now, for a process that binds it later (another process may take it meanwhile:
    a coordinator's own port is reserved instead)."""
    with socket.socket(_family(host)) as probe:
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
