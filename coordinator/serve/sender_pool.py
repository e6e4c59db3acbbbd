"""The coordinator's sender processes (`--senders N`) and its end of their connections.

With senders, the coordinator accepts every connection itself and reads its HELLO. A rank's
connection is then handed to the sender serving the fewest (coordinator/serve/sender_process.py); its
session runs here as before (RoutedSessions), so credits, ACKs, exactly-once and resume are
unchanged, but the batch bytes go from the step arena to the socket in the sender's process.
Control and relay connections stay with the coordinator.

STARTING (`spawn`, before the event loop) -> SERVING (`start`, then `serve` accepts) ->
STOPPED (`stop`: the routes close and the senders exit). A sender that dies stops the job
with an error naming it: its ranks' connections died with it.

The senders are started before the job knows how many ranks will connect. The first
authenticated HELLO of a rank (which says the world) or of a relay (whose ranks' streams the
loop serves) decides how many to keep, `keep(world or None)`; the others are RETIRED before
any connection is handed to them: their routes close and they exit. With none kept, the
ranks' connections are served by the loop, as control and relay connections are.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from omniload.coordinator.pool.worker_pool import describe_exit
from omniload.coordinator.serve.routed_sessions import ROUTE_PIECE, RoutedSessions, RouteOut, Session, read_routes
from omniload.coordinator.serve.sender_process import HANDOFF
from omniload.coordinator.serve.sessions import HANDSHAKE_S, MAX_HANDSHAKES, StreamInbox, peer_name
from omniload.errors import OmniloadError, ProtocolError
from omniload.protocol import MAX_CONTROL_HEADER, PREFIX, FrameDecoder, Kind, Message, encode, parse_prefix, read_hello

log = logging.getLogger("omniload")

_HANDOFF_S = 10.0  # a sender that does not take a connection in this long is stuck
_STOP_S = 5.0
_REFUSE_DRAIN_S = 2.0


class _Sender:
    def __init__(self, index: int, process: subprocess.Popen, routes: socket.socket, handoffs: socket.socket) -> None:
        self.index, self.process = index, process
        self.routes_socket, self.handoffs = routes, handoffs
        self._sessions: RoutedSessions | None = None
        self.next_conn = 0

    @property
    def sessions(self) -> RoutedSessions:
        """The sessions it serves, known once its routes are open (SenderPool.open)."""
        if self._sessions is None:
            raise RuntimeError(f"{self.name}: its routes are not open yet")
        return self._sessions

    @sessions.setter
    def sessions(self, sessions: RoutedSessions) -> None:
        self._sessions = sessions

    @property
    def name(self) -> str:
        return f"sender {self.index} (pid {self.process.pid})"


class Accepting:
    """The rank port while senders serve; like asyncio.Server, `close()` stops accepting."""

    def __init__(self, listener: socket.socket, task: asyncio.Task) -> None:
        self.sockets = [listener]
        self._task = task

    def close(self) -> None:
        self._task.cancel()
        self.sockets[0].close()


class SenderPool:
    def __init__(
        self,
        count: int,
        arena_path: Path,
        fail: Callable[[str, BaseException], None],
        token: bytes,
        keep: Callable[[int | None], int],
    ) -> None:
        self._count, self._arena_path, self._fail = count, arena_path, fail
        self._token, self._keep = token, keep
        self._senders: list[_Sender] = []
        self._retired: list[_Sender] = []  # more than the world needs: exiting, or gone
        self._sized = False  # the first authenticated rank or relay decided how many to keep
        self._accepting: set[asyncio.Task] = set()  # connections whose HELLO is being read
        self._reading: list[asyncio.Task] = []  # each sender's routes
        self._stopping = False
        self._opening = 0  # connections whose HELLO is being read (at most MAX_HANDSHAKES)

    def spawn(self) -> None:
        """Start the sender processes; call before the event loop starts."""
        for index in range(self._count):
            routes, routes_far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            handoffs, handoffs_far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            far = (routes_far.fileno(), handoffs_far.fileno())
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "omniload.coordinator.serve.sender_process",
                    "--routes-fd",
                    str(far[0]),
                    "--fds-fd",
                    str(far[1]),
                    "--arena",
                    str(self._arena_path),
                ],
                pass_fds=far,
            )
            routes_far.close()
            handoffs_far.close()
            self._senders.append(_Sender(index, process, routes, handoffs))

    async def start(self, session: Session) -> None:
        """On the loop: open each sender's routes and watch it."""
        loop = asyncio.get_running_loop()
        for sender in self._senders:
            reader, writer = await asyncio.open_unix_connection(sock=sender.routes_socket)
            sender.sessions = RoutedSessions(RouteOut(writer), session, sender.name, refs=True)
            reading = loop.create_task(read_routes(reader, sender.sessions, ROUTE_PIECE))
            reading.add_done_callback(functools.partial(self._routes_ended, sender=sender))
            self._reading.append(reading)
            sender.handoffs.setblocking(False)
            pidfd = os.pidfd_open(sender.process.pid)
            loop.add_reader(pidfd, self._on_exit, sender, pidfd)

    def listen(self, listener: socket.socket, session: Session) -> Accepting:
        """Accept on `listener` until the returned server is closed."""
        return Accepting(listener, asyncio.get_running_loop().create_task(self._accept(listener, session)))

    def kill(self) -> None:
        """The last resort, after the loop: no sender outlives the coordinator."""
        for sender in self._senders + self._retired:
            if sender.process.poll() is None:
                sender.process.kill()
                sender.process.wait()

    async def _accept(self, listener: socket.socket, session: Session) -> None:
        """Accept connections until cancelled; each one's HELLO decides where it goes."""
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        while True:
            sock, peer = await loop.sock_accept(listener)
            task = loop.create_task(self._route(sock, peer_name(peer), session))
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)

    async def stop(self) -> None:
        """Close every sender's routes and wait for the senders to exit; call after the ranks
        were told and given time to hang up (their sessions end here as the routes close)."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        for task in self._accepting:
            task.cancel()
        for sender in self._senders:
            _close_routes(sender)
        for sender in self._senders:
            try:
                await asyncio.wait_for(loop.run_in_executor(None, sender.process.wait), _STOP_S)
            except TimeoutError:
                sender.process.kill()
                await loop.run_in_executor(None, sender.process.wait)
        try:  # the routes end as the senders exit, and with them every session behind them
            await asyncio.wait_for(asyncio.gather(*self._reading, return_exceptions=True), _STOP_S)
        except TimeoutError:
            log.warning("the senders' sessions did not end in %gs; stopping anyway", _STOP_S)

    async def _route(self, sock: socket.socket, peer: str, session: Session) -> None:
        if self._opening >= MAX_HANDSHAKES:
            await _refuse(sock, f"too many connections are opening at once (over {MAX_HANDSHAKES}); try again")
            return
        self._opening += 1
        try:
            first = await _read_hello(sock)
            if not first:
                sock.close()
                return
            hello = read_hello(FrameDecoder().feed(first)[0])
        except (ProtocolError, TimeoutError, ConnectionError) as exc:
            await _refuse(sock, f"protocol error: {exc or 'no HELLO in time'}")
            return
        finally:
            self._opening -= 1
        if not self._sized and hello.role != "control" and hmac.compare_digest(hello.token.encode(), self._token):
            self.retire_beyond(self._keep(hello.world_size if hello.role == "rank" else None))
        if hello.role != "rank" or not self._senders:  # control and relay connections stay here
            reader, writer = await asyncio.open_connection(sock=sock)
            await session(StreamInbox(reader, first), writer, peer)
            return
        sender = min(self._senders, key=lambda s: s.sessions.live)
        conn = sender.next_conn
        sender.next_conn += 1
        sender.sessions.expect(conn, first)  # counted as the sender's from now: a burst spreads out
        try:
            await _send_fd(sender.handoffs, conn.to_bytes(HANDOFF, "little"), sock.fileno())
        except OSError as exc:
            sender.sessions.forget(conn)
            if not self._stopping:
                self._fail(sender.name, OmniloadError(f"could not hand a rank's connection to {sender.name}: {exc}"))
            return
        finally:
            sock.close()  # the sender holds the connection now
        asyncio.get_running_loop().call_later(_HANDOFF_S, self._check_taken, sender, conn)

    def retire_beyond(self, keep: int) -> None:
        """Keep the first `keep` senders and retire the others; once, before any connection is
        handed to a sender."""
        self._sized = True
        keep = max(0, min(len(self._senders), keep))
        retiring, self._senders = self._senders[keep:], self._senders[:keep]
        for sender in retiring:
            self._retired.append(sender)
            _close_routes(sender)  # the sender exits (see _on_exit)
        if retiring:
            log.info("%d of %d senders serve this job's ranks; the others exit", keep, keep + len(retiring))

    def _check_taken(self, sender: _Sender, conn: int) -> None:
        if sender.sessions.forget(conn) and not self._stopping:
            self._fail(
                sender.name,
                OmniloadError(
                    f"{sender.name} did not take a rank's connection in {_HANDOFF_S:g}s: it is stuck (a bug)"
                ),
            )

    def _on_exit(self, sender: _Sender, pidfd: int) -> None:
        asyncio.get_running_loop().remove_reader(pidfd)
        os.close(pidfd)
        sender.process.wait()
        if sender in self._retired:  # it served no one: its end is no rank's loss
            if sender.process.returncode != 0:
                log.warning("retired %s %s", sender.name, describe_exit(sender.process.returncode))
            return
        if not self._stopping:
            self._fail(
                sender.name,
                OmniloadError(
                    f"{sender.name} {describe_exit(sender.process.returncode)}; the ranks it served lost "
                    "their connections. Restart the job (with --resume) to go on"
                ),
            )

    def _routes_ended(self, task: asyncio.Task, sender: _Sender) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self._fail(f"the routes of {sender.name}", exc)


def _close_routes(sender: _Sender) -> None:
    """Close the coordinator's end of a sender's routes and handoffs: the sender writes what
    it holds and exits."""
    sender.sessions.out.flush()
    sender.sessions.out.writer.close()
    sender.handoffs.close()


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _send_fd(sock: socket.socket, message: bytes, fd: int) -> None:
    """sendmsg with SCM_RIGHTS on a non-blocking socket, waiting while the sender's queue is full."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            socket.send_fds(sock, [message], [fd])
            return
        except BlockingIOError:
            writable: asyncio.Future[None] = loop.create_future()
            loop.add_writer(sock.fileno(), _set_done, writable)
            try:
                await asyncio.wait_for(writable, _HANDOFF_S)
            finally:
                loop.remove_writer(sock.fileno())


async def _read_hello(sock: socket.socket) -> bytes:
    """A connection's first frame, read whole and nothing after it (the rest is the sender's)."""
    loop = asyncio.get_running_loop()
    data = bytearray()
    async with asyncio.timeout(HANDSHAKE_S):
        want = PREFIX.size
        while len(data) < want:
            chunk = await loop.sock_recv(sock, want - len(data))
            if not chunk:
                return b""
            data += chunk
            if len(data) == PREFIX.size:
                _, header_len, _ = parse_prefix(data, MAX_CONTROL_HEADER, 0)
                want += header_len
    return bytes(data)


async def _refuse(sock: socket.socket, message: str) -> None:
    """Say ERROR and close; what the peer sent is read first, so the close does not reset the
    connection and throw the ERROR away before the peer reads it."""
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(sock, encode(Message(Kind.ERROR, {"message": message})))
        sock.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(_REFUSE_DRAIN_S):
            while await loop.sock_recv(sock, 65536):
                pass
    except (OSError, TimeoutError):
        pass
    finally:
        sock.close()
