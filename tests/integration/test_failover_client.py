"""The rank's side of a failover, against fake coordinators: it goes on at the next address
from its own position, skips a coordinator of an older epoch, and keeps its positions."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest

from omniload.client import Loader
from omniload.coordinator.serve.batch_frames import encode_batch
from omniload.protocol import FrameDecoder, Kind, Message, encode
from omniload.state import RANK_KEY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


def _position(step: int) -> dict:
    return {"step": step}


class _Fake:
    """Accepts one rank: WELCOME at `epoch`, the batches of `steps`, then END or a hang-up."""

    def __init__(self, epoch: int, steps: list[int], end: bool = False) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.hello: dict | None = None
        self._epoch, self._steps, self._end = epoch, steps, end
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn, self.listener:
            decoder = FrameDecoder()
            while not (messages := decoder.feed(conn.recv(65536))):
                pass
            self.hello = messages[0].header
            at = (self.hello.get("resume") or _position(0))["step"]
            conn.sendall(encode(Message(Kind.WELCOME, {"epoch": self._epoch, "state": _position(at), "pid": 1})))
            for step in self._steps:
                arrays = {"input_ids": np.full((1, 4), step, np.int64), "cu_seqlens": np.array([0, 4], np.int32)}
                head, payload = encode_batch(step, arrays, {"state": _position(step + 1)}, b"{}")
                conn.sendall(head + bytes(payload))
            if self._end:
                conn.sendall(encode(Message(Kind.END, {"steps": self._steps[-1] + 1})))
                conn.recv(1 << 16)
            else:
                conn.shutdown(socket.SHUT_RDWR)  # the coordinator dies: the rank sees the stream end


def test_a_rank_goes_on_at_the_next_address_from_its_own_position_skipping_an_older_epoch():
    first, stale, successor = _Fake(2, [0, 1, 2]), _Fake(1, []), _Fake(3, [3, 4], end=True)
    loader = Loader(f"{first.addr},{stale.addr},{successor.addr}", "t", rank=0, world_size=1, prefetch=8)
    steps = []
    for batch in loader:
        steps.append(loader.step)
        assert int(batch["input_ids"][0, 0]) == loader.step
    loader.close()
    assert steps == [0, 1, 2, 3, 4]  # the three batches received before the loss are handed out, once
    assert successor.hello["resume"] == _position(3) and loader.info["epoch"] == 3
    assert stale.hello["resume"] == _position(3)  # asked, and refused for its epoch
    kept = {step: json.loads(loader.position(step)[RANK_KEY])["step"] for step in (0, 2, 4)}
    assert kept == {0: 1, 2: 3, 4: 5}  # positions from before the failover are kept
