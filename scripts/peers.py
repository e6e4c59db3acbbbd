"""Peer loaders for the memory benchmark: MosaicML streaming and LitData on the same files.

Each source's documents (in their file order) are converted once into the peer's own format
in the benchmark cache; each rank then reads every source with the peer's dataset (the
sources mixed by the peer: streaming's streams, LitData's CombinedStreamingDataset) inside a
plain DataLoader with the same worker count as the baseline, tokenizing and packing exactly
as the lean baseline does (colocated.pack_tokens). A peer that is not installed is skipped
with a message: they are benchmark-only dependencies (pip install mosaicml-streaming litdata).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

from torch.utils.data import DataLoader, IterableDataset

from omniload.workers.transforms import load_transform
from scripts.colocated import pack_tokens, rank_dataloader

PEERS = ("streaming", "litdata")


def missing(peer: str) -> str | None:
    """Why `peer` cannot run here, or None."""
    try:
        if peer == "streaming":
            stub_torchvision()
            import streaming  # noqa: F401
        else:
            import litdata  # noqa: F401
    except Exception as exc:  # an import error or a version clash: either way it cannot run
        return f"{type(exc).__name__}: {exc} (pip install mosaicml-streaming litdata)"
    return None


def stub_torchvision() -> None:
    """streaming's package imports its vision datasets, hence torchvision, which this text
    benchmark never uses and which may not match the installed torch: stand in empty modules
    (they hold nothing, so the peer's memory is not understated by a real torchvision)."""
    try:
        import torchvision  # noqa: F401

        return
    except Exception:
        pass
    for name in ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional"):
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})
    sys.modules["torchvision.datasets"].CIFAR10 = type("CIFAR10", (), {})
    sys.modules["torchvision.transforms.functional"].to_tensor = lambda x: x


stub_torchvision()  # here too: a DataLoader worker that is not forked imports this module first


def source_texts(spec_dict: dict) -> list[list[str]]:
    """Every source's values in file order, read with omniload's readers (the same files)."""
    from omniload.coordinator.pool.catalog import build_catalog
    from omniload.spec import Spec
    from omniload.workers.readers import read_shard

    return [
        [v for shard in src.shards for v in read_shard(shard, src.column)]
        for src in build_catalog(Spec.from_dict(spec_dict))
    ]


def cache_for(sources: list[dict]) -> Path:
    """Where the peers' copies of bench_data.make_sources' sources go: beside them, named as
    their folder (which names everything that makes them), so each copy is written once."""
    folder = Path(sources[0]["path"]).parent.parent
    return folder.with_name(f"peers-{folder.name}")


def convert(peer: str, spec_dict: dict, cache: Path) -> list[str]:
    """The peer's copy of every source (written once), one folder per source."""
    texts = None
    folders = []
    for i, source in enumerate(spec_dict["sources"]):
        folder = cache / peer / f"{source['name']}"
        folders.append(str(folder))
        if (folder / ".complete").exists():
            continue
        texts = texts or source_texts(spec_dict)
        folder.mkdir(parents=True, exist_ok=True)
        if peer == "streaming":
            stub_torchvision()
            from streaming import MDSWriter

            with MDSWriter(out=str(folder), columns={"text": "str"}, size_limit=1 << 26) as writer:
                for text in texts[i]:
                    writer.write({"text": text})
        else:
            from litdata import optimize

            optimize(fn=_litdata_item, inputs=texts[i], output_dir=str(folder), chunk_bytes="64MB", num_workers=1)
        (folder / ".complete").touch()
    return folders


def _litdata_item(text: str) -> dict:
    return {"text": text}


class Packed(IterableDataset):
    """The peer's dataset, its documents tokenized and packed as the lean baseline does;
    iterated in each DataLoader worker, where the peer splits the data by worker."""

    def __init__(self, inner: IterableDataset, rows: int, seq_len: int, tokenizer: str = "bytes") -> None:
        self.inner, self.rows, self.seq_len, self.tokenizer = inner, rows, seq_len, tokenizer

    def __iter__(self) -> Iterator:
        transform = load_transform(self.tokenizer)
        return pack_tokens((transform([item["text"]])[0] for item in self.inner), self.rows, self.seq_len)


def peer_loader(
    peer: str, folders: list[str], weights: list[float], rows: int, seq_len: int, workers: int, tokenizer: str = "bytes"
) -> DataLoader:
    """Must run in the rank, with RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE (streaming) and
    GLOBAL_RANK/NNODES (LitData) already in the environment."""
    if peer == "streaming":
        stub_torchvision()
        from streaming import Stream, StreamingDataset

        dataset = StreamingDataset(
            streams=[Stream(local=f) for f in folders], shuffle=True, shuffle_seed=0, batch_size=1, replication=None
        )
    else:
        from litdata import CombinedStreamingDataset, StreamingDataset

        total = sum(weights)
        dataset = CombinedStreamingDataset(
            [StreamingDataset(input_dir=f, shuffle=True, seed=0) for f in folders],
            weights=[w / total for w in weights],
            iterate_over_all=False,
            seed=0,
        )
    return rank_dataloader(Packed(dataset, rows, seq_len, tokenizer), workers)


def rank_environment(rank: int, world: int, port: int) -> None:
    """What torchrun would set, read by both peers to split the data by rank (one node);
    streaming starts a gloo process group of its own at MASTER_ADDR:MASTER_PORT."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GLOBAL_RANK=str(rank),
        NNODES="1",
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def clean_streaming_leftovers() -> None:
    """streaming keeps its per-job state in /dev/shm; a killed run leaves it behind."""
    if missing("streaming") is None:
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
