"""What a worker process is told at start: its lanes, how a source's images are decoded, and
(through its forkserver) the tokenizers loaded before it is forked.

The coordinator builds these and the worker reads them (workers/worker.py), so they live here,
owned by neither side. Starting the worker process is the pool's:
coordinator/pool/forkserver.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omniload.formats.shards import Shard
from omniload.storage.urls import StoreOptions

# The tokenizers the workers' forkserver loads before it forks them, a JSON list: the
# forkserver takes module names from the coordinator and, besides them, only its environment
PRELOADED_TOKENIZERS_ENV = "_OMNILOAD_FORKSERVER_TOKENIZERS"


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """How a source's images are decoded and where their placeholders go; one per job."""

    height: int
    width: int
    token: int  # the placeholder token id
    tokens_per_image: int
    transform: str | None = None  # module:function, instead of resize-and-crop

    @property
    def pixels(self) -> int:
        """Bytes of one decoded image."""
        return 3 * self.height * self.width


@dataclass(frozen=True, slots=True)
class Pretokenized:
    """How a source of token ids is read and checked: a flat token file's dtype and the id that
    ends each of its documents, and the vocabulary every id must fall below (None: unchecked)."""

    dtype: str = "uint16"
    eos: int | None = None
    vocab: int | None = None


@dataclass(frozen=True, slots=True)
class ChatConfig:
    """How a source's conversations become tokens and a label mask (workers/chat.py)."""

    seq_len: int  # a longer conversation is cut at a turn boundary, or dropped
    train_on: str = "assistant"  # assistant | all
    drop_long: bool = False  # --long-chats drop
    template: str | None = None  # the tokenizer's Jinja chat template; None: ChatML
    bos: str = ""  # the template's bos_token and eos_token
    eos: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneConfig:
    source_index: int
    source_name: str
    column: str
    tokenizer: str
    lane: int
    num_lanes: int
    ring_path: str
    shards: Sequence[Shard]  # the source's ShardTable (a tuple in tests)
    seed: int
    epochs: int  # 0: forever
    interleave: int  # shards read together, their rows in turn (omniload.order)
    start_group: int  # the source's cursor when the lane starts: it produces its turns from there
    start_pos: int  # (a restart's cursor may be part-way into a turn, even another lane's)
    skip_bad_files: bool
    image_column: str | None = None  # parquet/Arrow: the column of encoded images
    images: ImageConfig | None = None  # set when the source's samples carry images
    store: StoreOptions = StoreOptions()  # how to reach the source's store, if its files are URLs
    read_ahead: int = 64 << 20  # bytes of store objects the lane holds (omniload.storage.objects.Blocks)
    cache_dir: str | None = None  # --cache-dir
    cache_limit: int = 0
    pretokenized: Pretokenized | None = None  # set when the source holds token ids, not text
    chat: ChatConfig | None = None  # set when the source holds conversations


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    worker_id: int
    coordinator_pid: int
    lanes: tuple[LaneConfig, ...]
