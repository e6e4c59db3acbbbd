"""Rank processes for the tests, forked from a server that has imported torch once.

A fresh interpreter spends about 3 s of CPU importing torch, and the suite starts well over a
hundred rank processes on a 2-core CI machine. The server (`python tests/rank_forkserver.py
SOCKET`) imports torch, torch.distributed, numpy and the client, then forks one child per
request: a real process with its own pid, environment, stdout and stderr, that runs a rank
script (tests/rank_probe.py unless asked for another) as `python SCRIPT ARGS...` would.
`spawn()` returns a handle with the part of subprocess.Popen the tests use (poll, wait,
communicate, send_signal, kill, stderr).

Protocol, one unix-socket connection per child: the request is a length-prefixed JSON
{script, argv, env, cwd} with the child's stdout and stderr passed as file descriptors; the server
answers "PID\\n" once forked and "RETURNCODE\\n" (Popen's convention: -N for signal N) once
the child is reaped, then closes the connection. The server ends when its stdin closes.
"""

from __future__ import annotations

import array
import atexit
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).parent.parent
_PROBE = Path(__file__).with_name("rank_probe.py")
_HEADER = struct.Struct("!I")


class ForkedRank:
    """A child of the rank forkserver, handled like the subprocess.Popen it replaces."""

    def __init__(self, connection: socket.socket, args: list[str], stderr: Any) -> None:
        self._connection = connection
        self._answer = b""
        self.args = args
        self.stderr = stderr
        self.returncode: int | None = None
        line = self._read_line(30)
        if line is None:
            raise RuntimeError("the rank forkserver did not fork a rank in 30s")
        self.pid = int(line)

    def _read_line(self, timeout: float | None) -> str | None:
        """The server's next line; None when it did not come within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._answer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._connection.settimeout(left)
            try:
                chunk = self._connection.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError(f"the rank forkserver dropped rank pid {getattr(self, 'pid', '?')} (did it die?)")
            self._answer += chunk
        line, self._answer = self._answer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._read_line(0)
            if line is not None:
                self.returncode = int(line)
                self._connection.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._read_line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line)
            self._connection.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        """Read stderr to its end and wait, as Popen.communicate does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = []
        with selectors.DefaultSelector() as selector:
            selector.register(self.stderr, selectors.EVENT_READ)
            while chunk := self._read_some(selector, deadline, timeout):
                chunks.append(chunk)
        self.stderr.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return None, b"".join(chunks).decode(errors="replace")

    def _read_some(self, selector: selectors.BaseSelector, deadline: float | None, timeout: float | None) -> bytes:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if selector.select(left):
                return os.read(self.stderr.fileno(), 65536)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_server: subprocess.Popen | None = None
_server_path: str | None = None
_server_lock = threading.Lock()


def server_pid() -> int | None:
    """The forkserver's pid while it runs (the leak check leaves it, not its children, alone)."""
    return _server.pid if _server is not None and _server.poll() is None else None


def _start_server() -> str:
    global _server, _server_path
    with _server_lock:
        if _server is None or _server.poll() is not None:
            path = os.path.join(tempfile.mkdtemp(prefix="omniload-ranks-"), "fork.sock")
            _server = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), path],
                cwd=_ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            ready = _server.stdout.readline()
            if ready.strip() != b"ready":
                raise RuntimeError(f"the rank forkserver did not start (exit {_server.wait()})")
            _server_path = path
            atexit.register(_stop_server, _server, os.path.dirname(path))
        return _server_path


def _stop_server(server: subprocess.Popen, folder: str) -> None:
    server.stdin.close()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    shutil.rmtree(folder, ignore_errors=True)


def spawn(args: list[str], env: dict[str, str], script: Path = _PROBE) -> ForkedRank:
    """Start `python SCRIPT *args` as a fork of the server, with exactly `env`; its stderr is
    piped (as start_ranks always asked of Popen), its stdout is this process's fd 1."""
    path = _start_server()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    read_end, write_end = os.pipe()
    try:
        body = json.dumps({"script": str(script), "argv": args, "env": env, "cwd": os.getcwd()}).encode()
        connection.sendmsg(
            [_HEADER.pack(len(body)) + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [1, write_end]))]
        )
    finally:
        os.close(write_end)
    return ForkedRank(connection, [sys.executable, str(script), *args], os.fdopen(read_end, "rb", buffering=0))


# --- the server ---------------------------------------------------------------------------


def _serve(path: str) -> None:
    import numpy  # noqa: F401  what every rank imports, once
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401  the scripts that run under torchrun's environment use it

    import omniload.client  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = socket.socketpair()
    wake_read.setblocking(False)
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes the selector
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_read, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin.buffer, selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "stdin" and not os.read(sys.stdin.fileno(), 1):
                return  # the test session ended
            if key.data == "accept":
                connection, _ = listener.accept()
                pid = _fork_one(connection, [listener, wake_read, wake_write, connection, *children.values(), selector])
                if pid:
                    children[pid] = connection
            if key.data == "reap":
                try:
                    while wake_read.recv(512):
                        pass
                except BlockingIOError:
                    pass
        _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            try:
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the test no longer listens
            connection.close()


def _fork_one(connection: socket.socket, close_in_child: list) -> int:
    """Fork a child for the request on `connection`; the child's pid (0 when the request was bad)."""
    descriptors = array.array("i")
    try:
        head, fds, _, _ = connection.recvmsg(_HEADER.size, socket.CMSG_SPACE(2 * array.array("i").itemsize))
        for level, kind, data in fds:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                descriptors.frombytes(data[: len(data) - len(data) % descriptors.itemsize])
        (size,) = _HEADER.unpack(head)
        body = b""
        while len(body) < size:
            chunk = connection.recv(size - len(body))
            if not chunk:
                raise EOFError("the test hung up mid-request")
            body += chunk
        request = json.loads(body)
        pid = os.fork()
    except (OSError, EOFError, ValueError, struct.error):  # a bad request ends it, never the server
        for fd in descriptors:
            os.close(fd)
        connection.close()
        return 0
    if pid:
        for fd in descriptors:
            os.close(fd)
        try:
            connection.sendall(f"{pid}\n".encode())
        except OSError:
            pass  # the test no longer listens; the child is reaped all the same
        return pid
    try:
        code = _run_child(request, list(descriptors), close_in_child)
    except BaseException:  # noqa: BLE001 - a child must never return into the server's loop
        code = 1
    os._exit(code)


def _run_child(request: dict[str, Any], descriptors: list[int], close_in_child: list) -> int:
    import traceback

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for held in close_in_child:  # the server's sockets and selector: a rank holds only its own fds
        held.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(descriptors[0], 1)
    os.dup2(descriptors[1], 2)
    for fd in (null, *descriptors):
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [request["script"], *request["argv"]]
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))  # as `python SCRIPT` has it

    code = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as python would, with exit code 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # then exit hooks, as a fresh interpreter ends
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    _serve(sys.argv[1])
