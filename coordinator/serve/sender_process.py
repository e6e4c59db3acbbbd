"""`python -m omniload.coordinator.serve.sender_process`: writes batches to a share of the ranks' sockets.

The coordinator starts it (coordinator/serve/sender_pool.py) with two Unix sockets. On `--fds-fd` the
coordinator hands over each rank connection it accepted (SCM_RIGHTS, with its number for
it); the sender says OPEN for it on the routes once it serves it. On `--routes-fd` one ROUTE
stream runs both ways (omniload.route): what the ranks send goes up; the coordinator's frames
come down, their payloads as references into the shared step arena (`--arena`), which the
sender writes to the rank straight from shared memory. The sender keeps no job state:
credits, ACKs and positions stay with the coordinator. It exits when the coordinator's end
of the routes closes, so it never outlives the coordinator.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys

from omniload.coordinator.loop import run_loop
from omniload.coordinator.serve.arena import open_arena
from omniload.coordinator.serve.forwarding import Forwarder

HANDOFF = 8  # bytes of a handoff message: the connection's number, little-endian


async def serve(routes_fd: int, fds_fd: int, arena_path: str) -> int:
    loop = asyncio.get_running_loop()
    arena = open_arena(arena_path)
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=routes_fd))
    forwarder = Forwarder(writer, arena)
    handoffs = socket.socket(fileno=fds_fd)
    handoffs.setblocking(False)
    tasks: set[asyncio.Task] = set()

    async def take(conn: int, sock: socket.socket) -> None:
        local_reader, local_writer = await asyncio.open_connection(sock=sock)
        await forwarder.serve_local(conn, local_reader, local_writer)  # OPEN first: then the coordinator writes

    def on_handoff() -> None:
        while True:
            try:
                number, fds, _, _ = socket.recv_fds(handoffs, HANDOFF, 1)
            except BlockingIOError:
                return
            if not number:  # the coordinator closed its end
                loop.remove_reader(handoffs.fileno())
                return
            sock = socket.socket(fileno=fds[0])
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.create_task(take(int.from_bytes(number, "little"), sock))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    loop.add_reader(handoffs.fileno(), on_handoff)
    try:
        await forwarder.forward_down(reader)
    finally:
        loop.remove_reader(handoffs.fileno())
        forwarder.close_all()
        writer.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m omniload.coordinator.serve.sender_process")
    parser.add_argument("--routes-fd", type=int, required=True)
    parser.add_argument("--fds-fd", type=int, required=True)
    parser.add_argument("--arena", required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C stops the coordinator, which then closes us
    return run_loop(serve(args.routes_fd, args.fds_fd, args.arena))


if __name__ == "__main__":
    sys.exit(main())
