"""The trainer integrations' framework-free parts (omniload.integrations.batches and
titan_batches): what a trainer trains on and what its checkpoint holds. No framework imported."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader

from omniload.errors import ConfigError
from omniload.integrations.batches import LoaderDataset, trained_step, unshifted_labels
from omniload.integrations.titan_batches import TitanBatches


def _packed_row() -> dict[str, torch.Tensor]:
    """One row, two segments [0, 3) and [3, 5), labels and positions as omniload makes them."""
    return {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
        "labels": torch.tensor([[6, 7, -100, 9, -100]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
    }


def test_unshifted_labels_give_back_omniloads_targets_after_the_models_own_shift():
    labels = _packed_row()["labels"]
    hf = unshifted_labels(labels)
    assert hf.tolist() == [[-100, 6, 7, -100, 9]]  # a segment's first token is no target of the one before
    # a transformers causal LM predicts hf[:, 1:] from positions :-1 and pads the last with -100
    shifted = torch.cat([hf[:, 1:], torch.full((1, 1), -100)], dim=1)
    assert torch.equal(shifted, labels)


@pytest.mark.parametrize("optimizer_steps, per_step, step", [(0, 1, -1), (4, 1, 3), (3, 2, 5)])
def test_trained_step_is_the_loader_step_of_the_last_batch_trained(optimizer_steps, per_step, step):
    assert trained_step(optimizer_steps, per_step) == step


def test_trained_step_refuses_impossible_counts():
    with pytest.raises(ValueError, match="batches_per_step >= 1"):
        trained_step(3, 0)


def test_loader_dataset_hands_out_the_loaders_batches_transformed_and_keeps_no_state():
    batches = [_packed_row(), {k: v + 1 for k, v in _packed_row().items()}]
    dataset = LoaderDataset(batches, lambda b: {"ids": b["input_ids"]})
    got = list(DataLoader(dataset, batch_size=None))
    assert [b.keys() for b in got] == [{"ids"}, {"ids"}]
    assert all(torch.equal(g["ids"], b["input_ids"]) for g, b in zip(got, batches))
    # a framework that saves any iterable with a state_dict would save a read-ahead position
    assert not hasattr(dataset, "state_dict")


def test_loader_dataset_says_when_the_loader_has_no_more_batches():
    ended = []
    dataset = LoaderDataset([_packed_row()], on_end=lambda: ended.append(True))
    assert len(list(dataset)) == 1 and ended == [True]


class _FakeLoader:
    """What TitanBatches uses of omniload's Loader: batches, and a position after each."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches, self.position, self.loaded = batches, "start", None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i, batch in enumerate(self.batches):
            self.position = f"after {i}"
            yield batch

    def state_dict(self) -> dict[str, str]:
        return {"omniload_loader_state": self.position}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = state_dict


def test_titan_batches_yield_torchtitans_input_dict_and_labels():
    row = _packed_row()
    [(inputs, labels)] = list(TitanBatches(_FakeLoader([row])))
    assert inputs.keys() == {"input", "positions"}
    assert torch.equal(inputs["input"], row["input_ids"]) and torch.equal(inputs["positions"], row["position_ids"])
    assert torch.equal(labels, row["labels"])  # torchtitan's labels are already the next token


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: DCP says so, rightly
def test_titan_batches_save_the_position_after_the_last_batch_and_load_it_through_dcp(tmp_path):
    saving = TitanBatches(_FakeLoader([_packed_row()] * 3))
    assert isinstance(saving, Stateful)
    it = iter(saving)
    next(it), next(it)
    dcp.save({"dataloader": saving}, checkpoint_id=str(tmp_path))  # as torchtitan's checkpointer does
    restoring = TitanBatches(_FakeLoader([]))
    dcp.load({"dataloader": restoring}, checkpoint_id=str(tmp_path))
    assert restoring.loader.loaded == {"omniload_loader_state": "after 1"}


def test_titan_batches_leave_the_loader_at_the_start_for_an_empty_state():
    loader = _FakeLoader([])
    TitanBatches(loader).load_state_dict({})  # a checkpoint saved without a data loader
    assert loader.loaded is None


def test_frameworks_that_need_whole_rows_refuse_a_context_parallel_job_at_the_first_batch():
    cp_job = _FakeLoader([_packed_row()])
    cp_job.info = {"layout": {"tp": 1, "cp": 2, "dp": 1, "pp": 1}}
    with pytest.raises(ConfigError, match="torchtitan's data loader takes whole rows, but the job has --cp 2"):
        next(iter(TitanBatches(cp_job)))
    with pytest.raises(ConfigError, match="OmniloadTrainer .* --cp 2"):
        next(iter(LoaderDataset(cp_job, whole_rows_for="OmniloadTrainer (it shifts labels)")))
    plain = _FakeLoader([_packed_row()])
    plain.info = {"layout": {"tp": 1, "cp": 1, "dp": 1, "pp": 1}}
    assert len(list(TitanBatches(plain))) == 1


def test_the_document_masks_keep_each_token_to_its_own_document():
    """FlexAttention's block mask and the dense mask give the attention of each packed
    document computed alone (a varlen kernel's result), rows and padding included."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from omniload.integrations.document_mask import dense_mask, flex_block_mask

    rows, seq_len, heads, dim = 2, 64, 2, 8
    cu = torch.tensor([0, 20, 64, 100, 120, 128], dtype=torch.int32)  # the last: a row's padding
    torch.manual_seed(0)
    q, k, v = (torch.randn(rows, heads, seq_len, dim) for _ in range(3))
    flat = [t.transpose(1, 2).reshape(rows * seq_len, heads, dim) for t in (q, k, v)]
    pieces = []
    for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each document by itself
        part = [t[start:stop].transpose(0, 1) for t in flat]
        pieces.append(F.scaled_dot_product_attention(*part, is_causal=True).transpose(0, 1))
    alone = torch.cat(pieces).reshape(rows, seq_len, heads, dim).transpose(1, 2)
    batch = {"input_ids": torch.zeros(rows, seq_len, dtype=torch.long), "cu_seqlens": cu}
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(cu, rows, seq_len).unsqueeze(1))
    flex = flex_attention(q, k, v, block_mask=flex_block_mask(batch))
    assert torch.allclose(dense, alone, atol=1e-5)
    assert torch.allclose(flex, alone, atol=1e-5)
