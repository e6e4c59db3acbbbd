"""The job's options, one row each: the group, help, value and checks of every Spec field but
`sources`. The CLI's flags and their OMNILOAD_<NAME> variables (omniload.cli), `--help` and
docs/cli.md's tables (omniload.cli_docs), a --config file's groups, an integer's least value
and a choice's words, and which fields decide the batches (the job identity) all come from here;
omniload.spec refuses to import if a field has no row or a row no field."""

from __future__ import annotations

from dataclasses import dataclass

ON_BAD_FILE = ("stop", "skip")
LONG_DOCS = ("split", "drop", "bucket")
LONG_CHATS = ("truncate", "drop")
PP_DATA = ("first-last", "all")
BROADCAST_AT = ("none", "tp")
CP_SPLITS = ("sequence", "row")  # coordinator/plan/parallel.py
RANK_TOKENS = ("fixed", "variable")
# The groups, in the order `--help` and docs/cli.md show them; "high availability" has no field,
# only flags of `launch` and `serve`.
GROUP_NAMES = (
    "data",
    "batching",
    "plan",
    "parallel",
    "workers",
    "checkpoint",
    "serving",
    "high availability",
    "storage",
)


@dataclass(frozen=True, slots=True)
class Option:
    """One Spec field's row."""

    group: str  # its section of `--help` and docs/cli.md, and its group in a --config file
    help: str  # markdown, as docs/cli.md shows it; `--help` shows it plain
    metavar: str = ""  # the flag's value (N, S, PATH); a choice's is its choices; none: an on/off flag
    shown_default: str = ""  # the default as the docs say it, where the value alone would mislead
    choices: tuple[str, ...] = ()
    at_least: int | None = None  # an integer's least value
    runtime: bool = False  # changes how the job runs, never which batches it yields
    in_bytes: bool = False  # a number, or one with a unit (64MB, 2GiB)
    only_for: str = ""  # "chat" or "images": matters only when a source has them
    has_flag: bool = True  # False: given in a --config file or Python only

    def __post_init__(self) -> None:
        # a misspelt group or only_for would drop the option from --help or from the job identity's rules
        if self.group not in GROUP_NAMES:
            raise ValueError(f"unknown option group {self.group!r}; groups: {', '.join(GROUP_NAMES)}")
        if self.only_for not in ("", "chat", "images"):
            raise ValueError(f"only_for must be '', 'chat' or 'images', got {self.only_for!r}")


OPTIONS: dict[str, Option] = {
    "tokenizer": Option(
        "data",
        "`bytes` (UTF-8 bytes, vocabulary 256), a Hugging Face `tokenizer.json` path (`pip install "
        "'omniload[tokenizers]'`), a Hugging Face Hub model id `ORG/NAME[@REVISION]` (its `tokenizer.json` and "
        "chat template, fetched once by the coordinator into huggingface_hub's cache; `HF_TOKEN` and "
        "`HF_HUB_OFFLINE=1` honoured), or `module:function` mapping one text to a list of ints.",
        metavar="T",
    ),
    "epochs": Option(
        "data", "Passes over each source (0: repeat forever, reshuffled each epoch).", metavar="N", at_least=0
    ),
    "on_bad_file": Option(
        "data",
        "At an unreadable file or a bad sample: stop the job naming it, or skip it with a warning.",
        choices=ON_BAD_FILE,
    ),
    "image_size": Option(
        "data", "Size every image is resized and center-cropped to.", metavar="HxW", only_for="images"
    ),
    "image_transform": Option(
        "data",
        "From a PIL image to uint8 `[3, H, W]`, instead of resize-and-crop.",
        metavar="module:function",
        only_for="images",
    ),
    "image_token": Option(
        "data", "Placeholder token id of an image (needed when a source has images).", metavar="ID", only_for="images"
    ),
    "tokens_per_image": Option(
        "data", "Placeholder tokens per image in `input_ids`.", metavar="N", at_least=1, only_for="images"
    ),
    "shard_interleave": Option(
        "data", "Shards each source reads at once, taking their rows in turn.", metavar="K", at_least=1
    ),
    "seq_len": Option("batching", "Tokens per row.", metavar="N", at_least=2),
    "rows": Option("batching", "Rows per batch on each data-parallel rank.", metavar="N", at_least=1),
    "steps": Option(
        "batching", "Stop after this many steps (0: when the data ends).", metavar="N", at_least=0, runtime=True
    ),  # only where to stop: a resumed run may go further
    "long_docs": Option(
        "batching",
        "Documents longer than `seq_len`: split into chunks, drop, or keep their chunks together in whole rows "
        "of one rank.",
        choices=LONG_DOCS,
    ),
    "long_chats": Option(
        "batching",
        "Conversations (`kind=chat`) longer than `seq_len`: cut after the last whole message that fits and has "
        "trained tokens (dropped when none does), or drop them. A conversation is never split between rows; "
        "`omniload status` counts both. See [sources.md](sources.md#conversations-kindchat).",
        choices=LONG_CHATS,
        only_for="chat",
    ),
    "max_doc_share": Option(
        "batching", "Most of one rank's tokens a single document may fill in a step (at least one chunk).", metavar="F"
    ),
    "rank_tokens": Option(
        "batching",
        "`fixed`: every data-parallel rank gets `rows x seq_len` tokens. `variable`: the step holds as many "
        "tokens in all, but each rank gets its own number, as one packed sequence (`input_ids` `[1, L]`), so "
        "that the ranks' costs are equal ([planning.md](planning.md#variable-token-budgets)). With `--cp` > 1, "
        "only with `--cp-split sequence`.",
        choices=RANK_TOKENS,
    ),
    "max_rank_tokens": Option(
        "batching",
        "With `--rank-tokens variable`: the most tokens (real and padding) of a rank's sequence (0: 2 x rows x "
        "seq_len; at least rows x seq_len).",
        metavar="N",
        at_least=0,
    ),
    "pad_to": Option(
        "batching",
        "With `--rank-tokens variable`: a rank's sequence is padded up to a multiple of N (never past "
        "`--max-rank-tokens`), so a compiled model sees few shapes.",
        metavar="N",
        at_least=1,
    ),
    "seed": Option("plan", "Seed of every shuffle: same seed, spec and files give the same batches.", metavar="N"),
    "plan_ahead": Option(
        "plan", "Steps the planner may run ahead of the slowest rank.", metavar="N", at_least=1, runtime=True
    ),
    "mixture": Option(
        "plan", "Phases of source weights over steps or tokens (a --config file's `mixture`).", has_flag=False
    ),
    "balance": Option(
        "plan",
        "Cost model for balancing ranks: `tokens`, `attention`, or `module:function` "
        "([planning.md](planning.md#compute-balance)).",
        metavar="MODEL",
    ),
    "cost_coeffs": Option(
        "plan", "Coefficients of the attention cost `a*len^2 + b*len + c + d*images`.", metavar="a,b,c[,d]"
    ),
    "cost_model": Option(
        "plan",
        "The model's shape, `layers=L,hidden=H,heads=N,ffn=F,vocab=V[,kv_heads=K]`, or a preset (`llama-1b`, "
        "`llama-8b`, `llama-70b`): sets the attention cost's coefficients from the training FLOPs of that model "
        "([planning.md](planning.md#cost-from-the-models-shape)). Give it or `--cost-coeffs`, not both.",
        metavar="SHAPE|PRESET",
    ),
    "balance_window": Option(
        "plan", "Steps a hard-to-place segment may wait for a better step.", metavar="K", at_least=0
    ),
    "shuffle_window": Option(
        "plan",
        "The job's shuffle horizon in segments of `seq_len` tokens, split among sources by weight: each unit "
        "waits a seeded share of it and a long document's chunks spread evenly over it; each epoch's first as "
        "many tokens (its fill) are read before its first draw, so an epoch within it is a global shuffle (0: a "
        "horizon of 2**28 tokens and at least 64 global batches, a fill of 2**27 and at least 16) "
        "([planning.md](planning.md#what-a-batch-holds-mixture-shuffle-interleave)).",
        metavar="N",
        at_least=0,
    ),
    "shuffle_fill": Option(
        "plan",
        "Segments of `seq_len` tokens of each epoch read before its first draw, split among sources by weight: "
        "an epoch within it is a global shuffle of its units; less makes the first batch come sooner, at the "
        "cost of a less mixed start of each epoch (0: 2**27 tokens and at least 16 global batches; at most the "
        "horizon).",
        metavar="N",
        at_least=0,
    ),
    "shuffle_dir": Option(
        "plan",
        "Local disk where documents wait for the shuffle: up to about the horizon's tokens at 2 bytes each (4 "
        "where ids pass 65,535), in files removed as they empty and unlinked from the start.",
        metavar="PATH",
        shown_default="the temp folder",
        runtime=True,
    ),
    "tp": Option("parallel", "Tensor-parallel size.", metavar="N", at_least=1),
    "pp": Option("parallel", "Pipeline-parallel size.", metavar="N", at_least=1),
    "cp": Option("parallel", "Context-parallel size.", metavar="N", at_least=1),
    "cp_split": Option(
        "parallel",
        "With `--cp` > 1, what is cut between a replica's cp ranks: every packed sequence, padded to a multiple "
        "of 2*cp (Transformer Engine's THD layout, with `cu_seqlens_padded`), or every row (padded BSHD rows) "
        "([planning.md](planning.md#hybrid-parallelism)).",
        choices=CP_SPLITS,
        runtime=True,
    ),
    "rank_order": Option(
        "parallel",
        "Order of the parallel axes in the rank number, fastest first (Megatron's by default).",
        metavar="ORDER",
    ),
    "pp_data": Option(
        "parallel", "Pipeline stages that receive data; the others get an empty batch every step.", choices=PP_DATA
    ),
    "broadcast_at": Option(
        "parallel",
        "`tp`: one rank per tensor-parallel group connects and broadcasts each batch to the others.",
        choices=BROADCAST_AT,
        runtime=True,
    ),
    "workers": Option(
        "workers",
        "Total source-worker processes. `N` splits them among sources by weight once (one lane per worker). "
        "`auto` (or 0): up to this host's CPUs (its affinity; `OMNILOAD_CPUS=N` overrides it) less "
        "`--reserve-cpus`: it starts with one worker, doubles while a source starves with every worker busy, "
        "halves while they idle, and re-splits online by each source's measured cost per token "
        "([architecture.md](architecture.md#source-workers-lanes-and-autoscaling)).",
        metavar="N|auto",
        shown_default="auto (0)",
        at_least=0,
        runtime=True,
    ),
    "reserve_cpus": Option(
        "workers",
        "With `--workers auto`: CPUs left to the ranks and the coordinator.",
        metavar="N",
        at_least=0,
        runtime=True,
    ),
    "autoscale_every": Option(
        "workers",
        "With `--workers auto`: seconds between decisions to grow, shrink or re-split the pool (0: the "
        "budget's workers, split by weight once).",
        metavar="S",
        runtime=True,
    ),
    "ring_mb": Option(
        "workers",
        "Shared-memory ring size per worker lane, in MB (bounds one record).",
        metavar="N",
        at_least=1,
        runtime=True,
    ),
    "max_restarts": Option(
        "workers", "Restarts of a crashed worker before the job fails.", metavar="N", at_least=0, runtime=True
    ),
    "worker_timeout": Option(
        "workers", "Seconds without a sample from a source before the job fails naming it.", metavar="S", runtime=True
    ),
    "checkpoint_dir": Option(
        "checkpoint",
        "Folder for the coordinator's snapshots and per-step log ([checkpoint.md](checkpoint.md)).",
        metavar="DIR",
        runtime=True,
    ),
    "snapshot_every": Option(
        "checkpoint",
        "Steps between full snapshots; a resume replays at most this many steps.",
        metavar="N",
        at_least=1,
        runtime=True,
    ),
    "keep_snapshots": Option(
        "checkpoint",
        "Snapshots kept in `--checkpoint-dir` (older ones and their logs are removed).",
        metavar="N",
        at_least=1,
        runtime=True,
    ),
    "resume": Option(
        "checkpoint",
        "Checkpoint folder to resume from when the ranks bring no loader state.",
        metavar="DIR",
        runtime=True,
    ),
    "allow_changed_data": Option(
        "checkpoint", "Resume even if the spec or files changed (recorded in the folder).", runtime=True
    ),
    "rank_timeout": Option(
        "serving",
        "Seconds a rank the others wait for may stay silent (no ACK, or disconnected) before the job fails "
        "naming it; a rank that has not connected yet is only named (0: wait forever).",
        metavar="S",
        runtime=True,
    ),
    "metrics_port": Option(
        "serving",
        "Serve Prometheus metrics at `http://HOST:P/metrics` (0: any free port; the log names it). See "
        "[observability.md](observability.md).",
        metavar="P",
        runtime=True,
    ),
    "senders": Option(
        "serving",
        "Processes that write batches to the ranks' sockets from shared memory (0: the coordinator itself; -1: "
        "one per 64 connecting ranks, at most one per 8 cores: none below 64 ranks, with relays or on small "
        "machines).",
        metavar="N",
        runtime=True,
    ),
    "read_ahead": Option(
        "storage",
        "Bytes of a store's objects each worker lane holds: fetched ahead of its reads, and kept for re-reads "
        "(a parquet row group's strided passes). See [storage.md](storage.md).",
        metavar="BYTES",
        shown_default="64MB",
        at_least=1 << 20,
        in_bytes=True,
        runtime=True,
    ),
    "cache_dir": Option(
        "storage",
        "Keep blocks of a store's objects on local disk (`auto`: `$XDG_CACHE_HOME/omniload`), for epoch 2, a "
        "restart and the next job; also keeps the sources' catalog.",
        metavar="PATH|auto",
        shown_default="off",
        runtime=True,
    ),
    "cache_limit": Option(
        "storage",
        "Bytes `--cache-dir` may hold; least recently used blocks are removed first.",
        metavar="BYTES",
        shown_default="16GB",
        at_least=1 << 20,
        in_bytes=True,
        runtime=True,
    ),
}

GROUPS: dict[str, tuple[str, ...]] = {
    group: tuple(name for name, option in OPTIONS.items() if option.group == group) for group in GROUP_NAMES
}
GROUP_OF = {name: option.group for name, option in OPTIONS.items()}
# Fields that change how the job runs, never which batches it yields: not in the job identity.
RUNTIME_FIELDS = tuple(name for name, option in OPTIONS.items() if option.runtime)
# Fields in bytes: a number, or one with a unit (64MB, 2GiB).
BYTE_FIELDS = tuple(name for name, option in OPTIONS.items() if option.in_bytes)
# Fields that matter only when a source holds conversations, or has images.
CHAT_FIELDS = tuple(name for name, option in OPTIONS.items() if option.only_for == "chat")
IMAGE_FIELDS = tuple(name for name, option in OPTIONS.items() if option.only_for == "images")
