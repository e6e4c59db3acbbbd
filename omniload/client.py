"""The rank client: `omniload.connect()` inside a training script.

A background thread receives whole BATCH frames into fresh buffers; tensors are views of
them (`torch.frombuffer`), so a batch is never copied after the socket. Every batch handed to
the caller is acknowledged, which returns one credit: the coordinator never sends more than
`prefetch` batches ahead of what this rank consumed. A rank process that ends without
calling close() still says goodbye (atexit), so the coordinator knows it stopped on purpose.
"""
from __future__ import annotations

import atexit
import os
import queue
import socket
import sys
import threading
import time
import weakref
from typing import Any

import torch

from omniload.errors import ConfigError, OmniloadError, ProtocolError
from omniload.protocol import PREFIX, Kind, Message, encode, parse_header, parse_prefix

_CONNECT_S = 30.0
_WAIT_WARN_S = 60.0
_CLOSE_S = 5.0
_MAX_HEADER = 16 << 20
_MAX_PAYLOAD = 1 << 40
_DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "uint8": torch.uint8}


def connect(addr: str | None = None, token: str | None = None, *, rank: int | None = None,
            world_size: int | None = None, prefetch: int = 4, broadcast_at: str | None = None) -> Loader:
    """Connect this rank to its job's coordinator.

    Defaults come from the environment that `omniload launch` and torchrun set:
    OMNILOAD_ADDR, OMNILOAD_TOKEN, OMNILOAD_BROADCAST_AT, RANK and WORLD_SIZE. With
    broadcast_at="tp", call it on every rank after torch.distributed.init_process_group."""
    addr = addr or os.environ.get("OMNILOAD_ADDR")
    token = token or os.environ.get("OMNILOAD_TOKEN")
    if not addr or not token:
        raise ConfigError("OMNILOAD_ADDR and OMNILOAD_TOKEN are not set: start the job with "
                          "`omniload launch ... -- CMD`, or pass addr= and token= from `omniload serve`")
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    broadcast_at = broadcast_at or os.environ.get("OMNILOAD_BROADCAST_AT", "none")
    if broadcast_at == "tp":
        from omniload.broadcast import BroadcastLoader

        return BroadcastLoader(addr, token, rank, world_size, prefetch)
    if broadcast_at != "none":
        raise ConfigError(f"broadcast_at must be 'none' or 'tp', got {broadcast_at!r}")
    return Loader(addr, token, rank, world_size, prefetch)


class Loader:
    """Iterate to get `dict[str, torch.Tensor]` batches; see the README's batch schema.

    Implements torch's Stateful protocol: `state_dict()` is the loader position after the
    last batch handed out; `load_state_dict()`, before the first batch, resumes from one.
    The connection is opened on first use (iteration, `info`), so a state can be loaded first.
    """

    def __init__(self, addr: str, token: str, rank: int, world_size: int, prefetch: int) -> None:
        self.addr, self.rank, self.world_size = addr, rank, world_size
        self._token, self._prefetch = token, prefetch
        self._resume: dict[str, Any] | None = None
        self._position: dict[str, Any] | None = None
        self._info: dict[str, Any] | None = None
        self.step: int | None = None  # the last step handed out
        self.meta: dict[str, Any] = {}
        self.wait_seconds = 0.0  # time spent waiting for data inside __next__
        self._inbox: queue.Queue = queue.Queue()
        self._done = False
        self._sock: socket.socket | None = None
        self.note: str | None = None  # the coordinator's last word on why no batch comes
        self._closed = False

    @property
    def info(self) -> dict[str, Any]:
        """The coordinator's WELCOME: job id, fingerprint, dp, seq_len, rows, sources, layout."""
        if self._info is None:
            self._handshake()
        return self._info

    def state_dict(self) -> dict[str, str]:
        """The loader position after the last consumed batch, to save with the model."""
        from omniload.state import to_rank_dict

        return to_rank_dict(self._position)  # None before first use: the job's start

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from a saved position; call before the first batch."""
        from omniload.state import from_rank_dict

        if self._sock is not None:
            raise OmniloadError("load_state_dict() must be called before the loader is used "
                                "(before iterating or reading .info)")
        self._resume = self._position = from_rank_dict(state_dict)

    def _handshake(self) -> None:
        host, _, port = self.addr.rpartition(":")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=_CONNECT_S)
        except (OSError, ValueError) as exc:
            raise OmniloadError(f"cannot reach the coordinator at {self.addr}: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = {"token": self._token, "rank": self.rank, "world_size": self.world_size,
                 "credits": max(1, self._prefetch)}
        if self._resume is not None:
            hello["resume"] = self._resume
        try:
            self._sock.sendall(encode(Message(Kind.HELLO, hello)))
            kind, header, _ = self._receive_frame()
            if kind is Kind.ERROR:
                raise OmniloadError(f"coordinator at {self.addr} refused rank {self.rank}: {header.get('message')}")
            if kind is not Kind.WELCOME:
                raise ProtocolError(f"expected WELCOME from {self.addr}, got {kind.name}")
        except BaseException:
            self._sock.close()
            self._sock = None  # not connected: close() has nothing to do, a retry starts afresh
            raise
        self._sock.settimeout(None)
        self._info = header
        self._position = header.get("state")
        self._thread = threading.Thread(target=self._receive_loop, name=f"omniload-rank{self.rank}", daemon=True)
        self._thread.start()
        self._at_exit = _close_at_exit(weakref.ref(self))
        atexit.register(self._at_exit)

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._done:
            raise StopIteration
        if self._sock is None:
            self._handshake()
        started = time.perf_counter()
        item = self._take()
        self.wait_seconds += time.perf_counter() - started
        kind, header, payload = item
        if kind is Kind.END:
            self._done = True
            raise StopIteration
        if kind is Kind.ERROR:
            self._done = True
            raise OmniloadError(f"coordinator at {self.addr}: {header.get('message')}")
        batch = {t["name"]: _tensor(payload, t) for t in header["tensors"]}
        self.step = header["step"]
        self._position = header.get("state")
        self.meta = {k: v for k, v in header.items() if k not in ("tensors", "state")}
        try:
            # the time spent waiting so far rides along: `omniload status` shows each rank's wait %
            self._sock.sendall(encode(Message(Kind.ACK, {"step": self.step, "wait": round(self.wait_seconds, 3)})))
        except OSError:
            pass  # the connection is lost: the receive thread says why at the next batch
        return batch

    def close(self) -> None:
        """Hang up gracefully: the coordinator reads every ACK sent before it sees the end."""
        self._done = True
        if self._sock is None or self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        try:
            self._sock.sendall(encode(Message(Kind.BYE, {"step": self.step})))
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._thread.join(_CLOSE_S)  # it ends when the coordinator closes its side
        self._sock.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self) -> tuple:
        while True:
            try:
                item = self._inbox.get(timeout=_WAIT_WARN_S)
            except queue.Empty:
                why = f"the coordinator says: {self.note}" if self.note else "is a source slow?"
                print(f"omniload: rank {self.rank}: no batch from {self.addr} for {_WAIT_WARN_S:.0f}s; still "
                      f"waiting ({why})", file=sys.stderr)
                continue
            if isinstance(item, BaseException):
                self._done = True
                raise OmniloadError(f"lost the coordinator at {self.addr}: {item}") from item
            return item

    def _receive_loop(self) -> None:
        try:
            while True:
                frame = self._receive_frame()
                if frame[0] is Kind.WAIT:  # not a batch: why none comes, said while this rank waits
                    self.note = frame[1].get("message")
                    print(f"omniload: rank {self.rank} waits: {self.note}", file=sys.stderr)
                    continue
                self._inbox.put(frame)
                if frame[0] in (Kind.END, Kind.ERROR):
                    return
        except Exception as exc:  # handed to the training thread, which raises it
            self._inbox.put(exc)

    def _receive_frame(self) -> tuple[Kind, dict[str, Any], bytearray]:
        prefix = self._receive_exactly(PREFIX.size)
        kind, header_len, payload_len = parse_prefix(prefix, _MAX_HEADER, _MAX_PAYLOAD)
        header = parse_header(self._receive_exactly(header_len))
        return kind, header, self._receive_exactly(payload_len)

    def _receive_exactly(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view = memoryview(buffer)
        while view:
            got = self._sock.recv_into(view)
            if not got:
                raise ConnectionError("the coordinator closed the connection")
            view = view[got:]
        return buffer


def _close_at_exit(ref: weakref.ref) -> Any:
    """An atexit hook that closes the loader if it still exists (and does not keep it alive)."""
    def close() -> None:
        loader = ref()
        if loader is not None:
            loader.close()
    return close


def _tensor(payload: bytearray, spec: dict[str, Any]) -> torch.Tensor:
    dtype = _DTYPES[spec["dtype"]]
    count = 1
    for dim in spec["shape"]:
        count *= dim
    if count == 0:
        return torch.empty(spec["shape"], dtype=dtype)
    return torch.frombuffer(payload, dtype=dtype, count=count, offset=spec["offset"]).view(spec["shape"])
