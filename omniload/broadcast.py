"""`broadcast_at="tp"`: one rank per tensor-parallel group talks to the coordinator.

The group's first rank receives each batch and broadcasts it to the others over
torch.distributed in the training process group, so the coordinator's connections and
outbound bytes divide by tp. Every rank of the job must call `omniload.connect()`: the
groups are created collectively, and rank 0 learns the layout from the coordinator first.
With device="cuda:N" every rank's batch is on its GPU before the broadcast, so the group's
backend must carry CUDA tensors (NCCL); without, the tensors are CPU ones (gloo).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from omniload.client import Loader
from omniload.errors import ConfigError, OmniloadError
from omniload.layout import Layout


class BroadcastLoader:
    """The Loader of a tensor-parallel group. Iteration, state_dict(), position() and the
    first use are collective: every rank of the job makes the same calls in the same order.
    Positions are kept by the group's leader (the last KEPT_POSITIONS, as a Loader keeps)."""

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
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "broadcast_at='tp' needs torch.distributed initialized "
                "(dist.init_process_group) before omniload.connect()"
            )
        self._args = (addr, token, rank, world_size, prefetch)
        self.pin_memory, self.device = pin_memory, device
        # Batches are CPU tensors unless device= puts them on a GPU, and an NCCL group cannot
        # carry CPU tensors ("No backend type associated with device type cpu"): such batches
        # and every header go over gloo side groups, whatever the job's default backend is.
        self._backend = None if device is not None else "gloo"
        self.rank, self.world_size = rank, world_size
        self._resume: dict[str, Any] | None = None
        self._loader: Loader | None = None
        self._group = None
        self.info: dict[str, Any] = {}
        self.step: int | None = None
        self.meta: dict[str, Any] = {}
        self.wait_seconds = 0.0
        self._done = False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._group is not None:
            raise OmniloadError("load_state_dict() must be called before the loader is used")
        self._resume = state_dict

    def _setup(self) -> None:
        """Rank 0 learns the layout; every rank makes every tp group; leaders connect."""
        addr, token, rank, world_size, prefetch = self._args
        own = Loader(*self._args, pin_memory=self.pin_memory, device=self.device) if rank == 0 else None
        if own and self._resume is not None:
            own.load_state_dict(self._resume)
        box: list[Any] = [own.info if own else None]
        dist.broadcast_object_list(box, src=0, group=dist.new_group(backend=self._backend))
        self.info = box[0]
        layout = Layout(**self.info["layout"])
        groups = {}
        for r in range(world_size):  # every rank creates every group, in the same order
            members = tuple(layout.group(r, "tp"))
            if members not in groups:
                groups[members] = dist.new_group(list(members), backend=self._backend)
        members = tuple(layout.group(rank, "tp"))
        self._group, self._leader = groups[members], members[0]
        if own is None and rank == self._leader:
            own = Loader(*self._args, pin_memory=self.pin_memory, device=self.device)
            if self._resume is not None:
                own.load_state_dict(self._resume)
        self._loader = own

    def __iter__(self) -> BroadcastLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._done:
            raise StopIteration
        if self._group is None:
            self._setup()
        started = time.perf_counter()
        batch, own_header = self._receive(self._loader) if self._loader else ({}, None)
        box: list[Any] = [own_header]
        dist.broadcast_object_list(box, src=self._leader, group=self._group)
        header: dict[str, Any] = box[0]
        if header.get("end") or header.get("error"):
            self._done = True
            if header.get("error"):
                raise OmniloadError(header["error"])
            raise StopIteration
        if not self._loader:
            batch = {
                name: torch.empty(
                    shape,
                    dtype=getattr(torch, dtype),
                    device=self.device,
                    pin_memory=self.pin_memory and self.device is None,
                )
                for name, dtype, shape in header["tensors"]
            }
        for name, _, _ in header["tensors"]:
            dist.broadcast(batch[name], src=self._leader, group=self._group)
        self.wait_seconds += time.perf_counter() - started
        self.step, self.meta = header["step"], header["meta"]
        return batch

    def _receive(self, loader: Loader) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        try:
            batch = next(loader)
        except StopIteration:
            return {}, {"end": True}
        except OmniloadError as exc:
            return {}, {"error": str(exc)}
        tensors = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in batch.items()]
        return batch, {"step": loader.step, "meta": loader.meta, "tensors": tensors}

    def state_dict(self, *, step: int | None = None) -> dict[str, str]:
        """The loader position after the last batch (global: the same on every rank); with
        step=, after that step (see position())."""
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise TypeError(f"step must be an int, got {step!r}")  # before the collective: every rank raises
        if self._group is None:
            self._setup()
        answer: tuple[str, Any] | None = None
        if self._loader:
            try:
                answer = ("state", self._loader.state_dict(step=step))
            except OmniloadError as exc:  # raised on every rank, not only the leader
                answer = ("error", str(exc))
        box: list[Any] = [answer]
        dist.broadcast_object_list(box, src=self._leader, group=self._group)
        kind, value = box[0]
        if kind == "error":
            raise OmniloadError(value)
        return value

    def position(self, step: int) -> dict[str, str]:
        """The loader position after `step`, one of the last KEPT_POSITIONS handed out; an
        OmniloadError naming the steps that can be asked for on every rank otherwise."""
        if step is None:
            raise TypeError("step must be an int, got None")
        return self.state_dict(step=step)

    def close(self) -> None:
        if self._loader:
            self._loader.close()

    def __enter__(self) -> BroadcastLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
