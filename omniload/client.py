"""The rank client: the Loader that `omniload.connect()` (omniload/rank_entry.py) returns inside
a training script.

A background thread receives whole BATCH frames into fresh buffers; tensors are views of
them (`torch.frombuffer`), so a batch is never copied after the socket. With pin_memory the
buffers are page-locked (the receive thread reads the socket straight into them), still with no
copy; with device= the training thread starts an asynchronous copy to the GPU. Every batch
handed to the caller is acknowledged, which returns one credit: the coordinator never sends
more than `prefetch` batches ahead of what this rank consumed. A rank process that ends without
calling close() still says goodbye (atexit), so the coordinator knows it stopped on purpose.

Each batch carries the loader position after it; the loader keeps the last KEPT_POSITIONS of
them, so a trainer that fetches the next batch before it saves can still save the position of
the step it trained on: `state_dict(step=...)`.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import math
import queue
import socket
import sys
import threading
import time
import warnings
import weakref
from typing import Any

import torch

from omniload.errors import ConfigError, OmniloadError
from omniload.protocol import Kind, Message
from omniload.rank_link import Link, ReceiveFailed, Refused, Unreachable

_FAILOVER_S = 120.0  # how long a rank looks for a coordinator to go on with (a standby taking over)
_RETRY_S = 0.05  # pause between two rounds over the addresses
_WAIT_WARN_S = 60.0
_CLOSE_S = 5.0
_DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "uint8": torch.uint8}
KEPT_POSITIONS = 16  # positions (after the last steps handed out) that position(step) can return


def placement(pin_memory: bool, device: str | torch.device | None) -> tuple[bool, torch.device | None]:
    """What pin_memory= and device= mean on this machine: (pin the buffers, the GPU to copy to).

    Without CUDA, pin_memory=True is a no-op with a warning, as for torch's
    DataLoader(pin_memory=True): page-locked memory only speeds up copies to a GPU, so the
    same training script should run unchanged on a CPU-only machine (a laptop, CI). A device
    there is none of cannot be honoured, so device="cuda..." is an error."""
    try:
        target = None if device is None else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is not a torch device: {exc}") from None
    if target is not None and target.type == "cpu":
        target = None
    if target is not None and target.type != "cuda":
        raise ConfigError(f"device must be a CUDA device or 'cpu', got {device!r}")
    if not pin_memory and target is None:
        return False, None  # the plain path never touches torch.cuda
    if not torch.cuda.is_available():
        if target is not None:
            raise ConfigError(
                f"device={device!r}, but CUDA is not available here (torch.cuda.is_available() "
                "is False); leave device unset to get CPU tensors"
            )
        warnings.warn(
            "omniload.connect(pin_memory=True): CUDA is not available, so batches are ordinary "
            "(not page-locked) CPU tensors",
            stacklevel=3,
        )
        return False, None
    return True, target  # a copy to a GPU is asynchronous only from page-locked memory: device pins


class Loader:
    """Iterate to get `dict[str, torch.Tensor]` batches; see the README's batch schema.

    Implements torch's Stateful protocol: `state_dict()` is the loader position after the
    last batch handed out (`step`); `position(step)` (or `state_dict(step=...)`) that after
    one of the last KEPT_POSITIONS steps; `load_state_dict()`, before the first batch, resumes
    from one. The connection is opened on first use (iteration, `info`), so a state can be
    loaded first.
    """

    def __init__(
        self,
        addr: str,
        token: str,
        rank: int,
        world_size: int,
        prefetch: int,
        *,
        pin_memory: bool = False,
        device: torch.device | None = None,
    ) -> None:
        """pin_memory and device as `placement()` resolved them (CUDA is there if either is set)."""
        # OMNILOAD_ADDR may list the primary and its standbys: "a,b,..."; self.addr is the one in use
        self.addrs = [a.strip() for a in addr.split(",") if a.strip()] or [addr]
        self.addr, self.rank, self.world_size = self.addrs[0], rank, world_size
        self._epoch = 0  # the highest coordinator epoch seen: an older one is never served from again
        self._token, self._prefetch = token, prefetch
        self.pin_memory, self.device = pin_memory, device
        self._resume: dict[str, Any] | None = None
        self._position: dict[str, Any] | None = None
        # (step, the position after it), consecutive steps, oldest first; the WELCOME's
        # position is that after the step before the first one this loader hands out
        self._positions: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(maxlen=KEPT_POSITIONS)
        self._info: dict[str, Any] | None = None
        self.step: int | None = None  # the last step handed out (steps count from 0 over the job)
        self.meta: dict[str, Any] = {}
        self.wait_seconds = 0.0  # time spent waiting for data inside __next__
        self._inbox: queue.Queue = queue.Queue()
        self._done = False
        self._link: Link | None = None
        self.note: str | None = None  # the coordinator's last word on why no batch comes
        self._closed = False

    @property
    def info(self) -> dict[str, Any]:
        """The coordinator's WELCOME: job id, fingerprint, dp, seq_len, rows, sources, layout."""
        if self._info is None:
            self._handshake()
        assert self._info is not None  # the handshake sets it, or raises
        return self._info

    def state_dict(self, *, step: int | None = None) -> dict[str, str]:
        """The loader position after the last batch handed out, to save with the model; with
        step=, the position after that step (see position())."""
        from omniload.state import to_rank_dict

        if step is not None:
            return self.position(step)
        return to_rank_dict(self._position)  # None before first use: the job's start

    def position(self, step: int) -> dict[str, str]:
        """The loader position after `step`, in state_dict()'s format: resuming from it yields
        step + 1 next. Any of the last KEPT_POSITIONS steps handed out can be asked for (and,
        until that many are, the step before the first one); others raise OmniloadError
        naming the steps that can."""
        from omniload.state import to_rank_dict

        return to_rank_dict(kept_position(self._positions, step))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from a saved position; call before the first batch."""
        from omniload.state import from_rank_dict

        if self._sock is not None:
            raise OmniloadError(
                "load_state_dict() must be called before the loader is used (before iterating or reading .info)"
            )
        self._resume = self._position = from_rank_dict(state_dict)
        self._keep_start(self._position)

    def _keep_start(self, position: dict[str, Any] | None) -> None:
        """Forget the kept positions but this one: where the steps this loader hands out start."""
        self._positions.clear()
        if position is not None:
            self._positions.append((position["step"] - 1, position))

    @property
    def _sock(self) -> socket.socket | None:
        return None if self._link is None else self._link.sock

    def _connected(self) -> Link:
        """The connection to the coordinator: set from a handshake until a failover or close."""
        if self._link is None:
            raise ConnectionError(f"rank {self.rank}: not connected to the coordinator")
        return self._link

    def _handshake(self) -> None:
        if len(self.addrs) > 1:
            self._connect_any()
        else:
            self._handshake_at(self.addr)

    def _connect_any(self, failing_over: bool = False) -> None:
        """Connect to the coordinator that serves the job among self.addrs, trying each in turn
        (failing over: from the one after the lost one, and a refusal is tried again too, since
        the lost one may still be stopping): a standby refuses connections until it takes over,
        and a new primary listens once it has replayed. Bounded by _FAILOVER_S."""
        deadline = time.monotonic() + _FAILOVER_S
        start = self.addrs.index(self.addr) + failing_over
        retry = (Unreachable, OSError, Refused) if failing_over else (Unreachable, OSError)
        tried: dict[str, str] = {}
        for attempt in itertools.count():
            addr = self.addrs[(start + attempt) % len(self.addrs)]
            try:
                self._handshake_at(addr)
                return
            except retry as exc:
                tried[addr] = str(exc)
            if (attempt + 1) % len(self.addrs) == 0:
                if time.monotonic() > deadline:
                    raise OmniloadError(
                        f"rank {self.rank}: no coordinator of {','.join(self.addrs)} served the job "
                        f"for {_FAILOVER_S:.0f}s: " + "; ".join(f"{a}: {e}" for a, e in tried.items())
                    )
                time.sleep(_RETRY_S)

    def _fail_over(self, cause: object) -> None:
        """The coordinator is gone (or lost its lease): go on at another address from this
        rank's own position, the one after the last batch handed out (batches received but
        not handed out are dropped: the next coordinator sends them again, identical)."""
        print(
            f"omniload: rank {self.rank}: lost the coordinator at {self.addr} ({cause}); going on after step "
            f"{self.step} with another of {','.join(self.addrs)}",
            file=sys.stderr,
        )
        self._connected().close()
        self._link = None
        atexit.unregister(self._at_exit)
        self._thread.join(_CLOSE_S)
        self._inbox = queue.Queue()
        self._resume, kept = self._position, list(self._positions)
        try:
            self._connect_any(failing_over=True)
        except BaseException:
            self._done = True
            raise
        self._positions.clear()
        self._positions.extend(kept)  # position(step) still answers for the steps before the takeover

    def _handshake_at(self, addr: str) -> None:
        self.addr = addr
        hello = {
            "token": self._token,
            "rank": self.rank,
            "world_size": self.world_size,
            "credits": max(1, self._prefetch),
        }
        if self._resume is not None:
            hello["resume"] = self._resume
        self._link, header = Link.greet(
            addr,
            hello,
            min_epoch=self._epoch,
            keepalive=len(self.addrs) > 1,
            page_locked=_page_locked_buffer if self.pin_memory else None,
        )
        self._info = header
        self._epoch = max(self._epoch, header.get("epoch", 0))
        self._position = header.get("state")
        self._keep_start(self._position)
        if self.pin_memory:  # the receive thread allocates on the GPU the training thread uses
            given = self.device.index if self.device is not None else None
            self._cuda_index = torch.cuda.current_device() if given is None else given
            if self.device is not None:  # "cuda": the current GPU when the loader connects
                self.device = torch.device("cuda", self._cuda_index)
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
        batch = self._schema({t["name"]: _tensor(payload, t) for t in header["tensors"]}, header.get("compact"))
        if self.device is not None:  # queued on the current stream: the trainer's kernels see the data
            batch = {name: t.to(self.device, non_blocking=True) for name, t in batch.items()}
        self.step = header["step"]
        self._position = header.get("state")
        if self._position is not None:
            self._positions.append((self.step, self._position))
        self.meta = {k: v for k, v in header.items() if k not in ("tensors", "state", "compact")}
        try:
            # the time spent waiting so far rides along: `omniload status` shows each rank's wait %
            self._connected().send(Message(Kind.ACK, {"step": self.step, "wait": round(self.wait_seconds, 3)}))
        except OSError:
            pass  # the connection is lost: the receive thread says why at the next batch
        return batch

    def _schema(self, received: dict[str, torch.Tensor], compact: bool) -> dict[str, torch.Tensor]:
        """The batch schema from what the frame holds (omniload.batch_arrays): labels and positions
        derived from compact frames, narrowed arrays widened. Derived arrays are page-locked
        with pin_memory, like the received ones."""
        import numpy as np

        from omniload.batch_arrays import expand, widen

        def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:  # the schema's arrays are int64
            if not self.pin_memory:
                return np.empty(shape, np.int64)
            return _page_locked(8 * math.prod(shape)).view(torch.int64).view(shape).numpy()

        views = {name: tensor.numpy() for name, tensor in received.items()}
        arrays = expand(views, empty) if compact else widen(views, empty)
        return {name: received[name] if a is views.get(name) else torch.from_numpy(a) for name, a in arrays.items()}

    def close(self) -> None:
        """Hang up gracefully: the coordinator reads every ACK sent before it sees the end."""
        self._done = True
        if self._link is None or self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        self._link.hang_up(self.step)
        self._thread.join(_CLOSE_S)  # it ends when the coordinator closes its side
        self._link.close()

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
                print(
                    f"omniload: rank {self.rank}: no batch from {self.addr} for {_WAIT_WARN_S:.0f}s; still "
                    f"waiting ({why})",
                    file=sys.stderr,
                )
                continue
            if isinstance(item, ReceiveFailed):
                self._done = True
                raise OmniloadError(str(item))
            if (
                len(self.addrs) > 1
                and not self._closed
                and (
                    isinstance(item, OSError)
                    or (isinstance(item, tuple) and item[0] is Kind.ERROR and item[1].get("fenced"))
                )
            ):
                self._fail_over(item if isinstance(item, OSError) else item[1].get("message"))
                continue
            if isinstance(item, BaseException):
                self._done = True
                raise OmniloadError(f"lost the coordinator at {self.addr}: {item}") from item
            return item

    def _receive_loop(self) -> None:
        try:
            if self.pin_memory:  # else page-locked memory would make a CUDA context on GPU 0
                torch.cuda.set_device(self._cuda_index)
            link = self._connected()
            while True:
                frame = link.receive_frame()
                if frame[0] is Kind.WAIT:  # not a batch: why none comes, said while this rank waits
                    self.note = frame[1].get("message")
                    print(f"omniload: rank {self.rank} waits: {self.note}", file=sys.stderr)
                    continue
                self._inbox.put(frame)
                if frame[0] in (Kind.END, Kind.ERROR):
                    return
        except Exception as exc:  # handed to the training thread, which raises it
            self._inbox.put(exc)


def _close_at_exit(ref: weakref.ref) -> Any:
    """An atexit hook that closes the loader if it still exists (and does not keep it alive)."""

    def close() -> None:
        loader = ref()
        if loader is not None:
            loader.close()

    return close


def kept_position(positions: collections.deque[tuple[int, Any]], step: int) -> Any:
    """The position kept for `step` among consecutive (step, position) pairs, oldest first;
    OmniloadError naming the steps that can be asked for if it is not kept."""
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step must be an int, got {step!r}")
    if not positions:
        raise OmniloadError(
            f"no position after step {step} is kept: the loader has not connected yet (the "
            "first batch or reading .info connects it; state_dict() is the start until then)"
        )
    first, last = positions[0][0], positions[-1][0]
    if first <= step <= last:
        return positions[step - first][1]
    why = f"step {step} has not been handed out yet" if step > last else f"step {step} is too old"
    raise OmniloadError(
        f"{why}: ask for a step from {first} to {last} (the loader keeps its last "
        f"{positions.maxlen} positions: after each step it handed out, and before its first)"
    )


def _page_locked_buffer(size: int) -> torch.Tensor:
    return _page_locked(size)  # looked up when called: a test swaps _page_locked


def _page_locked(size: int) -> torch.Tensor:
    """From torch's caching host allocator: freed buffers are reused once their copies are done."""
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _tensor(payload: bytearray | torch.Tensor, spec: dict[str, Any]) -> torch.Tensor:
    dtype = _DTYPES[spec["dtype"]]
    count = 1
    for dim in spec["shape"]:
        count *= dim
    if isinstance(payload, torch.Tensor):  # page-locked: views keep it pinned
        return payload[spec["offset"] : spec["offset"] + count * dtype.itemsize].view(dtype).view(spec["shape"])
    if count == 0:
        return torch.empty(spec["shape"], dtype=dtype)
    return torch.frombuffer(payload, dtype=dtype, count=count, offset=spec["offset"]).view(spec["shape"])
