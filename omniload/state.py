"""The loader position: what a checkpoint holds, and its rank-side wrapper.

A position, not a snapshot: plain ints, floats and strings that the coordinator can replay
from. Everything else (ring contents, worker state, token arrays) is recomputed on restore.

    version      int, STATE_VERSION
    fingerprint  hash of the data-deciding spec fields and the files (sizes, row counts)
    step         steps completed: the next step to deliver
    cursors      per source [group, pos]: the next sample to read in its deterministic order
    spreads      per source its shuffle's position, or null (the next one starts at the cursor):
                 {start: [group, pos], clock, horizon, fill, frontier: [key, sample_id],
                  passed: [[key, sample_id]...], ended, drawn_since_end}
                 (see omniload.coordinator.plan.spread)
    passes       per source float: the mixture's stride passes
    weights      per source float: the weights of the last step
    tokens       tokens drawn so far (for schedules over tokens)
    dropped      documents dropped so far (long_docs=drop)
    carry        chosen but not delivered, in order: [source, sample_id, length,
                 position_start, group, delay, doc group, doc pos] (where its document is)
    live         live mixture changes so far: [step, {source: weight}]
"""

from __future__ import annotations

from typing import Any

import orjson

from omniload.errors import ConfigError

STATE_VERSION = 4  # 2: shuffle windows, interleaved shard order; 3: strided slices (order.Slicing); 4: spreads
KEYS = (
    "version",
    "fingerprint",
    "step",
    "cursors",
    "spreads",
    "passes",
    "weights",
    "tokens",
    "dropped",
    "carry",
    "live",
)
RANK_KEY = "omniload_loader_state"  # the one key of a rank's state_dict (a JSON string: DCP-friendly)


def check_state(state: Any, where: str) -> dict[str, Any]:
    """Validate a position read from a file or a rank; raises ConfigError naming the problem."""
    if not isinstance(state, dict):
        raise ConfigError(f"{where}: loader state must be a mapping, got {type(state).__name__}")
    if state.get("version") != STATE_VERSION:
        raise ConfigError(
            f"{where}: loader state version {state.get('version')} is not supported "
            f"(this omniload reads version {STATE_VERSION}): resume with the omniload that "
            "wrote it, or start the job afresh"
        )
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise ConfigError(f"{where}: loader state lacks {', '.join(missing)}")
    return state


def to_rank_dict(state: dict[str, Any] | None) -> dict[str, str]:
    """None (a loader not used yet) saves as the job's start."""
    return {RANK_KEY: orjson.dumps(state).decode()}


def from_rank_dict(data: dict[str, Any]) -> dict[str, Any] | None:
    if not isinstance(data, dict) or RANK_KEY not in data:
        raise ConfigError(f"not an omniload loader state: expected a dict with the key {RANK_KEY!r}")
    raw = data[RANK_KEY]
    state = orjson.loads(raw if isinstance(raw, (str, bytes)) else bytes(raw))
    return None if state is None else check_state(state, "load_state_dict")
