"""A standby's port is reserved from its start (listening.reserve): no other process can take
the address it announced before it takes over and listens there."""

from __future__ import annotations

import socket

import pytest

from omniload.coordinator.serve.listening import bind, reserve
from omniload.errors import ConfigError


def test_a_reserved_port_is_taken_by_no_one_else_and_refuses_ranks_until_it_listens():
    reserved = reserve("127.0.0.1", 0, "--port")
    try:
        port = reserved.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind("127.0.0.1", port, "--port")  # another coordinator (or anything) cannot have it
        with pytest.raises(ConnectionRefusedError):  # a rank that tries it early is refused, not left hanging
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        listener = bind("127.0.0.1", port, "--port", reserved)  # the takeover
        assert listener is reserved
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            conn, _ = listener.accept()
            conn.close()
    finally:
        reserved.close()
