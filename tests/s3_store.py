"""A real S3 endpoint on loopback for the tests: moto's server mode in its own process, and a
TCP proxy in front of it that adds latency and resets connections part-way through a response.

The store is real HTTP on a real socket (pyarrow's C++ client talks to it as to AWS); only
the objects' bodies live in memory. Objects are put with boto3, as a user would upload them.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from omniload.coordinator.serve.listening import free_port

# Fixed test credentials; a test that checks redaction sets its own secret.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "omniload-test-key",
    "AWS_SECRET_ACCESS_KEY": "omniload-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


class MotoServer:
    """`moto_server` on a free loopback port; `endpoint` is its http URL."""

    def __init__(self) -> None:
        self.port = free_port("127.0.0.1")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).read()
                return
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError("moto_server exited at start; is moto[server] installed?") from None
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto_server did not answer in 30 s")

    def client(self):  # noqa: ANN201  (boto3 is a test dependency only)
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def reset(self) -> None:
        """Forget every bucket (moto's reset API): each test starts from an empty store."""
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=10).read()

    def upload(self, bucket: str, root: Path, prefix: str = "") -> None:
        """Put every file under `root` at `prefix` + its path relative to root."""
        client = self.client()
        client.create_bucket(Bucket=bucket)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                client.put_object(Bucket=bucket, Key=prefix + path.relative_to(root).as_posix(), Body=path.read_bytes())

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultyProxy:
    """A TCP proxy to `target` that holds each request `delay_s` (a round trip) and, with `reset_every` = N,
    resets every Nth connection after some of the response
    body has passed: the reset in the middle of a body that S3 clients do not retry by
    themselves. `resets` counts the resets made. With `throttle_every` = M, every Mth connection
    is answered 503 SlowDown, as S3 throttles (`throttled` counts them). `requests` counts the
    requests passed on by kind: "HEAD object", "GET object", "GET list" (a listing: a GET with a
    query). Runs in threads of the test process."""

    def __init__(
        self,
        target_port: int,
        delay_s: float = 0.0,
        reset_every: int = 0,
        cut_after: int = 600,
        throttle_every: int = 0,
    ) -> None:
        self.target_port, self.delay_s, self.reset_every, self.cut_after = target_port, delay_s, reset_every, cut_after
        self.throttle_every = throttle_every
        self.resets = self.connections = self.throttled = 0
        self.requests: Counter[str] = Counter()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                cut = self.reset_every and self.connections % self.reset_every == 0
                throttle = self.throttle_every and self.connections % self.throttle_every == 0
            target = self._throttle if throttle else self._serve
            threading.Thread(target=target, args=(client, cut), daemon=True).start()

    def _throttle(self, client: socket.socket, _cut: bool) -> None:
        """Read the request, answer 503 SlowDown and close, as a throttling S3 does."""
        try:
            client.settimeout(10)
            request = b""
            while b"\r\n\r\n" not in request and (data := client.recv(65536)):
                request += data
            client.sendall(
                b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                + b"Content-Length: %d\r\n\r\n" % len(_SLOW_DOWN)
                + _SLOW_DOWN
            )
            with self._lock:
                self.throttled += 1
        except OSError:
            pass
        finally:
            client.close()

    def _serve(self, client: socket.socket, cut: bool) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        answered = [True]  # a response went back since the last request bytes: the next ones start a request
        threading.Thread(target=self._pipe, args=(client, upstream, answered, False), daemon=True).start()
        self._pipe(upstream, client, answered, cut, request=False)

    def _pipe(
        self, source: socket.socket, sink: socket.socket, answered: list[bool], cut: bool, request: bool = True
    ) -> None:
        sent = 0
        try:
            while data := source.recv(65536):
                if request and answered[0]:  # a request's first bytes: "METHOD /path HTTP/1.1"
                    method, _, rest = data.partition(b" ")
                    kind = f"{method.decode(errors='replace')} {'list' if b'?' in rest.split(b' ', 1)[0] else 'object'}"
                    with self._lock:
                        self.requests[kind] += 1
                    if self.delay_s:  # a request waits a round trip, once, not per chunk
                        time.sleep(self.delay_s)
                answered[0] = not request
                if cut and sent + len(data) > self.cut_after:
                    sink.sendall(data[: max(0, self.cut_after - sent)])
                    with self._lock:
                        self.resets += 1
                    # linger 0: the close sends RST, the client sees a reset mid-body; the shutdown
                    # first wakes the thread reading the other way, which would keep the socket open
                    sink.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    for s in (sink, source):
                        try:
                            s.shutdown(socket.SHUT_RD)
                        except OSError:
                            pass
                    break
                sink.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._server.close()


def store_env(endpoint: str) -> dict[str, str]:
    """The environment a job reading the store needs: the standard AWS variables."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
