"""How many sender processes a job keeps once it knows its ranks: one per 64 that connect
(each sender is a process of ~24 MB; below that the coordinator's own writes keep up), none
for ranks behind relays, and always what --senders N asked for."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from omniload.coordinator.serve.dispatch import Dispatch
from omniload.coordinator.serve.sender_pool import SenderPool, _Sender
from omniload.spec import Spec


def _dispatch(**spec: object) -> Dispatch:
    return Dispatch(Spec.from_dict({"sources": ["a=x.parquet"], **spec}), "job", ["a"], lambda *_: None, b"t")


@pytest.mark.parametrize(
    ("spec", "world", "kept"),
    [
        ({}, 16, 0),
        ({}, 63, 0),
        ({}, 64, 1),
        ({}, 1024, 16),  # SenderPool keeps at most the ones it started (one per 8 cores)
        ({}, None, 0),  # the ranks come through relays: the loop serves their streams
        ({"tp": 8, "broadcast_at": "tp"}, 512, 1),  # 64 of the 512 connect
        ({"senders": 2}, 16, 2),  # asked for: kept whatever the world
        ({"senders": 2}, None, 2),
    ],
)
def test_senders_kept_follow_the_ranks_that_connect(spec, world, kept):
    assert _dispatch(**spec).size_senders(world) == kept


def test_frames_skip_the_step_arena_only_when_no_sender_is_kept():
    few, many = _dispatch(), _dispatch()
    few.size_senders(16)
    many.size_senders(128)
    assert (few._placing, many._placing) == (False, True)


class _Out:
    def __init__(self) -> None:
        self.closed = False
        self.writer = self

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class _Sessions:
    def __init__(self) -> None:
        self.out = _Out()


def test_retired_senders_get_their_routes_closed_and_the_kept_ones_do_not():
    senders = SenderPool(3, Path("/nonexistent"), lambda *_: None, b"t", lambda world: 1)
    pairs = [socket.socketpair() for _ in range(3)]
    for index, (near, _) in enumerate(pairs):
        sender = _Sender(index, None, near, near)  # type: ignore[arg-type]
        sender.sessions = _Sessions()  # type: ignore[assignment]
        senders._senders.append(sender)
    senders.retire_beyond(1)
    assert [s.index for s in senders._senders] == [0] and [s.index for s in senders._retired] == [1, 2]
    assert [s.sessions.out.closed for s in senders._senders + senders._retired] == [False, True, True]
    assert [s.handoffs.fileno() for s in senders._retired] == [-1, -1]  # handoffs closed: nothing more goes there
    for near, far in pairs:
        near.close()
        far.close()
