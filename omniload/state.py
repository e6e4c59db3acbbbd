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

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

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


@dataclass(frozen=True, slots=True)
class SpreadPosition:
    """Where a spread stands, in plain ints (a checkpoint's `spreads` entry)."""

    start: tuple[int, int]  # (group, pos) of the oldest document with a unit waiting, else the cursor
    clock: int  # the clock at start
    horizon: int
    fill: int
    frontier: tuple[int, int]  # the greatest (key, sample_id) drawn; (-1, -1) before the first
    passed: tuple[tuple[int, int], ...]  # (key, sample_id) below the frontier not drawn yet
    ended: bool = False  # the epoch has been read (Spread.end)
    drawn_since_end: int = 0  # tokens drawn since it ended (the next epoch is read as many)

    def to_json(self) -> dict[str, Any]:
        return {
            "start": list(self.start),
            "clock": self.clock,
            "horizon": self.horizon,
            "fill": self.fill,
            "frontier": list(self.frontier),
            "passed": [list(p) for p in self.passed],
            "ended": self.ended,
            "drawn_since_end": self.drawn_since_end,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpreadPosition:
        """Raises ValueError (naming the field) for a malformed entry: checked as the rest of
        the position is, by type and value (`_count`, `_ints`), nothing coerced."""
        try:
            start, frontier = _ints(data["start"], minimum=0), _ints(data["frontier"], minimum=-1)
            clock, horizon, fill = _count(data["clock"]), _count(data["horizon"]), _count(data["fill"])
            passed = tuple(_ints(p, minimum=0) for p in _typed(data["passed"], list))
            ended, drawn_since_end = data["ended"], _count(data["drawn_since_end"])
            if not isinstance(ended, bool):
                raise TypeError(f"ended: expected bool, got {type(ended).__name__}")
        except KeyError as exc:
            raise ValueError(
                "a spread position needs start, clock, horizon, fill, frontier, passed, ended, "
                f"drawn_since_end: {exc!r}"
            ) from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"a spread position out of range or of the wrong type: {exc}") from None
        if horizon < 1:
            raise ValueError(f"a spread position out of range: horizon {horizon}")
        return cls(start, clock, horizon, fill, frontier, passed, ended, drawn_since_end)


class Carried(NamedTuple):
    """A segment chosen but not delivered (a checkpoint's `carry` entry): enough to find its
    document again and rebuild it; stored as the plain list of these fields, in this order. A
    NamedTuple, not a frozen dataclass: the stepper makes one for each carried segment at every
    step, on the event loop (frozen dataclasses made the export 211 us against 93 at dp 256
    with 110 carried segments)."""

    source: int
    sample_id: int
    length: int
    position_start: int
    group: int
    delay: int
    doc_group: int  # where its document sits in the source's order (Segment.origin)
    doc_pos: int

    @property
    def origin(self) -> tuple[int, int]:
        return self.doc_group, self.doc_pos

    def to_json(self) -> list[int]:
        return list(self)


@dataclass(frozen=True, slots=True)
class LoaderState:
    """The loader position (see the module's doc), typed; `to_json` is what checkpoints and
    ranks hold, `from_json` checks every field by value and names the one that is wrong."""

    fingerprint: str
    step: int
    cursors: dict[str, tuple[int, int]]
    spreads: dict[str, SpreadPosition | None]
    passes: tuple[float, ...]
    weights: tuple[float, ...]
    tokens: int
    dropped: int
    carry: tuple[Carried, ...]
    live: tuple[tuple[int, dict[str, float]], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "step": self.step,
            "cursors": {name: list(cursor) for name, cursor in self.cursors.items()},
            "spreads": {name: None if p is None else p.to_json() for name, p in self.spreads.items()},
            "passes": list(self.passes),
            "weights": list(self.weights),
            "tokens": self.tokens,
            "dropped": self.dropped,
            "carry": [c.to_json() for c in self.carry],
            "live": [[at, dict(weights)] for at, weights in self.live],
        }

    @classmethod
    def from_json(cls, state: Any, where: str) -> LoaderState:
        """Raises ConfigError naming `where` and the field for anything but a position this
        omniload wrote."""
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
        field = "fingerprint"
        try:
            fingerprint = _typed(state["fingerprint"], str)
            field = "step"
            step = _count(state["step"])
            field = "tokens"
            tokens = _count(state["tokens"])
            field = "dropped"
            dropped = _count(state["dropped"])
            field = "cursors"
            cursors = {_typed(n, str): _ints(c, minimum=0) for n, c in _typed(state["cursors"], dict).items()}
            field = "spreads"
            spreads = {
                _typed(n, str): None if p is None else _spread(p) for n, p in _typed(state["spreads"], dict).items()
            }
            if set(spreads) != set(cursors):
                raise ValueError(f"names {sorted(spreads)}, the cursors' {sorted(cursors)}")
            field = "passes"
            passes = tuple(_number(x) for x in _typed(state["passes"], list))
            field = "weights"
            weights = tuple(_number(x) for x in _typed(state["weights"], list))
            field = "passes"
            if len(passes) != len(cursors) or len(weights) != len(cursors):
                raise ValueError(f"{len(passes)} passes and {len(weights)} weights for {len(cursors)} sources")
            field = "carry"
            carry = tuple(_carried(entry) for entry in _typed(state["carry"], list))
            field = "live"
            live = tuple(_change(entry) for entry in _typed(state["live"], list))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: loader state field {field!r} is malformed: {exc}") from None
        return cls(fingerprint, step, cursors, spreads, passes, weights, tokens, dropped, carry, live)


def _typed(value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {value!r:.60}")
    return value


def _count(value: Any) -> int:
    if _typed(value, int) < 0:
        raise ValueError(f"expected a count, got {value}")
    return int(value)


def _number(value: Any) -> float:
    """The number as it was read (an int stays one: the position round-trips byte for byte)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r:.60}")
    return value


def _ints(value: Any, minimum: int) -> tuple[int, int]:
    """A pair of ints, each at least `minimum`."""
    first, second = _typed(value, list)
    for x in (first, second):
        if _typed(x, int) < minimum:
            raise ValueError(f"expected ints of at least {minimum}, got {value}")
    return first, second


def _spread(value: Any) -> SpreadPosition:
    return SpreadPosition.from_json(_typed(value, dict))


def _carried(value: Any) -> Carried:
    fields = [_typed(x, int) for x in _typed(value, list)]
    if len(fields) != len(Carried._fields):
        raise ValueError(f"a carried segment has {len(Carried._fields)} fields, got {len(fields)}")
    return Carried(*fields)


def _change(value: Any) -> tuple[int, dict[str, float]]:
    at, weights = _typed(value, list)
    return _count(at), {_typed(n, str): _number(w) for n, w in _typed(weights, dict).items()}


def check_state(state: Any, where: str) -> dict[str, Any]:
    """Validate a position read from a file or a rank (LoaderState.from_json); returns it."""
    LoaderState.from_json(state, where)
    checked: dict[str, Any] = state  # a dict: from_json checked it
    return checked


def to_rank_dict(state: dict[str, Any] | None) -> dict[str, str]:
    """None (a loader not used yet) saves as the job's start."""
    return {RANK_KEY: orjson.dumps(state).decode()}


def from_rank_dict(data: dict[str, Any]) -> dict[str, Any] | None:
    if not isinstance(data, dict) or RANK_KEY not in data:
        raise ConfigError(f"not an omniload loader state: expected a dict with the key {RANK_KEY!r}")
    raw = data[RANK_KEY]
    state = orjson.loads(raw if isinstance(raw, (str, bytes)) else bytes(raw))
    return None if state is None else check_state(state, "load_state_dict")
