"""The rank client's pure parts: the kept positions, what pin_memory= and device= mean on this
machine, and tensors as views of a received payload (bytes or a page-locked buffer)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from omniload import client, rank_entry
from omniload.coordinator.serve.batch_frames import encode_batch
from omniload.errors import ConfigError, OmniloadError
from omniload.protocol import FrameDecoder, Kind

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the behaviour without CUDA")


def _kept(first: int, last: int, maxlen: int = 4) -> collections.deque:
    return collections.deque(((s, {"step": s + 1}) for s in range(first, last + 1)), maxlen=maxlen)


def test_a_kept_step_gives_the_position_after_it():
    positions = _kept(10, 13)
    assert [client.kept_position(positions, s)["step"] for s in range(10, 14)] == [11, 12, 13, 14]


@pytest.mark.parametrize(
    "step, why", [(9, "step 9 is too old"), (14, "step 14 has not been handed out yet"), (-1, "step -1 is too old")]
)
def test_a_step_not_kept_names_the_range(step, why):
    with pytest.raises(OmniloadError, match=f"{why}: ask for a step from 10 to 13 .*last 4 positions"):
        client.kept_position(_kept(10, 13), step)


def test_no_position_is_kept_before_the_loader_connects():
    with pytest.raises(OmniloadError, match="not connected yet"):
        client.kept_position(collections.deque(maxlen=4), 0)


@pytest.mark.parametrize("step", ["3", 3.0, True, None])
def test_a_step_must_be_an_int(step):
    with pytest.raises(TypeError, match="step must be an int"):
        client.kept_position(_kept(0, 3), step)


def test_a_loaded_state_is_kept_as_the_step_before_the_next():
    loader = client.Loader("127.0.0.1:1", "t", 0, 1, 4)
    with pytest.raises(OmniloadError, match="not connected yet"):
        loader.position(0)
    position = {"step": 7}
    loader._keep_start(position)  # what load_state_dict and the WELCOME do
    assert client.kept_position(loader._positions, 6) is position
    with pytest.raises(OmniloadError, match="ask for a step from 6 to 6"):
        loader.state_dict(step=7)


def test_without_pin_memory_or_device_cuda_is_never_asked(monkeypatch):
    def asked() -> bool:
        raise AssertionError("torch.cuda.is_available() called on the plain path")

    monkeypatch.setattr(torch.cuda, "is_available", asked)
    assert client.placement(False, None) == (False, None)
    assert client.placement(False, "cpu") == (False, None)


@NO_CUDA
def test_pin_memory_without_cuda_is_a_no_op_with_a_warning():
    with pytest.warns(UserWarning, match=r"pin_memory=True\): CUDA is not available"):
        loader = rank_entry.connect("127.0.0.1:1", "token", rank=0, world_size=1, pin_memory=True)
    assert (loader.pin_memory, loader.device) == (False, None)  # and it has not connected: that is lazy


@NO_CUDA
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_a_cuda_device_without_cuda_is_a_config_error(device):
    with pytest.raises(ConfigError, match="CUDA is not available here"):
        client.placement(False, device)


@pytest.mark.parametrize(
    "device, message", [("mps", "a CUDA device or 'cpu'"), ("gpu7", "not a torch device"), (3.5, "not a torch device")]
)
def test_a_device_that_is_not_cuda_or_cpu_is_a_config_error(device, message):
    with pytest.raises(ConfigError, match=message):
        client.placement(True, device)


def test_with_cuda_pin_memory_pins_and_device_implies_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert client.placement(True, None) == (True, None)
    assert client.placement(False, "cuda:1") == (True, torch.device("cuda", 1))


def test_tensors_are_the_same_views_of_a_byte_or_a_tensor_payload():
    arrays = {
        "input_ids": np.arange(15, dtype=np.int64).reshape(3, 5),
        "cu_seqlens": np.array([0, 7, 15], np.int32),
        "empty": np.zeros((0,), np.int64),
        "source": np.array([1, -1, 2], np.int64),
    }
    head, payload = encode_batch(3, arrays, {}, b"{}")
    (message,) = FrameDecoder(max_payload=1 << 20).feed(head + bytes(payload))
    assert message.kind is Kind.BATCH
    received = bytearray(message.payload)
    buffer = torch.frombuffer(bytearray(received), dtype=torch.uint8)  # stands in for the page-locked one
    for spec in message.header["tensors"]:
        from_bytes, from_buffer = client._tensor(received, spec), client._tensor(buffer, spec)
        assert from_buffer.dtype == from_bytes.dtype and torch.equal(from_buffer, from_bytes)
        assert torch.equal(from_bytes, torch.from_numpy(arrays[spec["name"]]))
        if from_buffer.numel():
            assert from_buffer.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
