"""`omniload.connect()`: a rank's entry point. It reads the job's address from the environment
and returns the loader the job's layout asks for: a Loader of its own (omniload/client.py), or
with broadcast_at="tp" a BroadcastLoader (omniload/broadcast.py), whose group leader alone
holds a connection."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from omniload.broadcast import BroadcastLoader
from omniload.client import Loader, placement
from omniload.errors import ConfigError


class RankLoader(Protocol):
    """What `connect()` returns, a Loader or a BroadcastLoader: the one interface the
    integrations (omniload/integrations/) and a training script rely on."""

    @property
    def info(self) -> dict[str, Any]:
        """What the coordinator said when this rank joined: the job, its layout, who serves it."""
        ...

    @property
    def step(self) -> int | None:
        """The last step handed out (steps count from 0 over the job); None before the first."""
        ...

    @property
    def meta(self) -> dict[str, Any]:
        """The last batch's meta (its tokens, the balance, documents a step)."""
        ...

    @property
    def wait_seconds(self) -> float:
        """Time spent waiting for batches inside iteration."""
        ...

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...

    def state_dict(self, *, step: int | None = None) -> dict[str, str]:
        """The loader position after the last batch handed out, or after batch `step`."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def connect(
    addr: str | None = None,
    token: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    prefetch: int = 4,
    broadcast_at: str | None = None,
    pin_memory: bool = False,
    device: str | torch.device | None = None,
) -> RankLoader:
    """Connect this rank to its job's coordinator.

    Defaults come from the environment that `omniload launch` and torchrun set:
    OMNILOAD_ADDR, OMNILOAD_TOKEN, OMNILOAD_BROADCAST_AT, RANK and WORLD_SIZE. With
    broadcast_at="tp", call it on every rank after torch.distributed.init_process_group.

    pin_memory=True hands out tensors in page-locked memory, ready for
    `.to(device, non_blocking=True)`; device="cuda:N" hands them out already on that GPU
    (copied asynchronously from page-locked memory, on the current stream). Without CUDA,
    pin_memory=True does nothing but warn once, and device="cuda..." is a ConfigError."""
    addr = addr or os.environ.get("OMNILOAD_ADDR")
    token = token or os.environ.get("OMNILOAD_TOKEN")
    if not addr or not token:
        raise ConfigError(
            "OMNILOAD_ADDR and OMNILOAD_TOKEN are not set: start the job with "
            "`omniload launch ... -- CMD`, or pass addr= and token= from `omniload serve`"
        )
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    broadcast_at = broadcast_at or os.environ.get("OMNILOAD_BROADCAST_AT", "none")
    if broadcast_at not in ("none", "tp"):
        raise ConfigError(f"broadcast_at must be 'none' or 'tp', got {broadcast_at!r}")
    pin, target = placement(pin_memory, device)
    if broadcast_at == "tp":
        return BroadcastLoader(addr, token, rank, world_size, prefetch, pin_memory=pin, device=target)
    return Loader(addr, token, rank, world_size, prefetch, pin_memory=pin, device=target)
