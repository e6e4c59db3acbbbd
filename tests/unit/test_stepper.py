"""The stepper over in-memory sources (no processes): per-step shares, long documents spread,
every segment once, and resume from any step identical to an uninterrupted run."""

from __future__ import annotations

from collections import Counter

import numpy as np
import orjson
import pytest

from omniload.coordinator.plan.documents import Doc
from omniload.coordinator.plan.stepper import Stepper
from omniload.spec import Spec
from tests.intakes import ListIntake

SEQ, ROWS, DP = 64, 4, 2


def heavy_tailed(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(40), 1.0, n)).astype(int)
    lengths[rng.choice(n, 3, replace=False)] = rng.integers(50 * SEQ, 100 * SEQ, 3)  # 50-100 chunks
    return lengths.tolist()


def _spec(**overrides) -> Spec:
    fields = dict(
        sources=[{"name": f"s{i}", "path": "x", "weight": w} for i, w in enumerate((0.5, 0.3, 0.2))],
        seq_len=SEQ,
        rows=ROWS,
        epochs=1,
        balance="tokens",
        shuffle_window=400,
    )
    return Spec.from_dict({**fields, **overrides})


def _stepper(
    spec: Spec, dp: int = DP, lengths=None, late: float = 0.0, seed: int = 0, intakes: list | None = None
) -> Stepper:
    """A Stepper over ListIntakes of `lengths` (or over `intakes`, intakes of a test's own)."""
    lengths = lengths or [heavy_tailed(i, 1500) for i in range(3)]
    intakes = intakes or [ListIntake(i, n, spec.epochs, late, seed + i) for i, n in enumerate(lengths)]
    stepper = Stepper(spec, intakes)
    stepper.dp = dp
    return stepper


def _run(stepper: Stepper, steps: int) -> list:
    out = []
    for _ in range(steps):
        step = stepper.next_step()
        if step is None:
            break
        out.append(step)
    return out


def _rank_rows(step, rank):
    batch = step.batches[rank]
    lengths = np.diff(batch["cu_seqlens"])
    return batch["source"], batch["sample_id"], lengths


def test_every_step_tracks_the_weights_within_about_one_segment():
    steps = _run(_stepper(_spec()), 80)
    errors = []
    for step in steps:
        tokens = np.zeros(3)
        for rank in range(DP):
            sources, _, lengths = _rank_rows(step, rank)
            np.add.at(tokens, sources[sources >= 0], lengths[sources >= 0])
        errors.append(np.abs(tokens - np.array([0.5, 0.3, 0.2]) * tokens.sum()).max())
    # a step holds DP*ROWS*SEQ = 512 tokens; the carry-over moves a segment or two between steps
    assert np.median(errors) <= SEQ
    assert max(errors) <= 3 * SEQ


def test_a_long_document_never_fills_a_rank_and_is_spread_over_many_steps():
    spec = _spec()
    steps = _run(_stepper(spec), 300)
    cap = spec.max_doc_share * ROWS * SEQ
    chunk_steps: dict = {}  # document -> the step of each of its full chunks
    for step in steps:
        for rank in range(DP):
            sources, ids, lengths = _rank_rows(step, rank)
            docs = {}
            for source, sid, n in zip(sources, ids, lengths):
                if source >= 0:
                    key = (int(source), int(sid) >> 12)
                    docs[key] = docs.get(key, 0) + int(n)
            assert max(docs.values()) <= max(cap, SEQ)
            for source, sid, n in zip(sources, ids, lengths):
                if n == SEQ:
                    chunk_steps.setdefault((int(source), int(sid) >> 12), []).append(step.number)
    longest = max(chunk_steps.values(), key=len)
    assert len(longest) >= 30
    # about one chunk a step, spread over a span of steps well beyond the document's length
    assert len(set(longest)) >= 0.9 * len(longest) and max(longest) - min(longest) >= 2 * len(longest)


@pytest.mark.parametrize("window", [1, 37, 800])
def test_every_segment_is_delivered_exactly_once_in_an_epoch(window):
    stepper = _stepper(_spec(shuffle_window=window))
    delivered = []
    for step in _run(stepper, 10_000):
        for rank in range(DP):
            sources, ids, _ = _rank_rows(step, rank)
            delivered += [(int(s), int(i)) for s, i in zip(sources, ids) if s >= 0]
    expected = sum(-(-n // SEQ) for i in range(3) for n in heavy_tailed(i, 1500))
    assert len(delivered) == len(set(delivered)) == expected


@pytest.mark.parametrize("long_docs", ["split", "drop", "bucket"])
@pytest.mark.parametrize("at", [1, 7, 33])
def test_resume_from_a_position_mid_spread_is_identical(at, long_docs):
    spec = _spec(long_docs=long_docs, epochs=2)
    lengths = [[0, 5] + n[:300] + [0] for n in (heavy_tailed(i, 300) for i in range(3))]  # empty documents too
    whole = _run(_stepper(spec, lengths=lengths), at + 25)
    first = _stepper(spec, lengths=lengths)
    _run(first, at)
    state = orjson.loads(orjson.dumps(first.state_dict("f")))  # as it travels and is stored
    assert any(s is not None for s in state["spreads"].values())
    resumed = _stepper(spec, lengths=lengths)
    resumed.load_state_dict(state)
    for a, b in zip(whole[at:], _run(resumed, 25), strict=True):
        for x, y in zip(a.batches, b.batches, strict=True):
            assert all(np.array_equal(x[k], y[k]) for k in x)


def test_resume_at_every_step_across_epochs_read_ahead_is_identical():
    """Small epochs, so that every few steps one epoch is drawn empty while the next is read
    ahead: a position saved at any step (the next epoch part read, or not yet) resumes on the
    batches and positions of the uninterrupted run, and every epoch delivers each document's
    chunks once. The records arrive late at random, differently in each run: what a position
    holds must follow from the draws, never from which records were in the rings (a standby
    and a trace replay compare positions)."""
    spec = _spec(epochs=4, shuffle_window=6)
    lengths = [[40, 3, 200, 64, 7, 90, 30, 5][: 5 + i] * 3 for i in range(3)]
    stepper, whole, states, read_ahead = _stepper(spec, lengths=lengths, late=0.3), [], [], 0
    while (step := stepper.next_step()) is not None:
        whole.append(step)
        states.append(stepper.state_dict("f"))
        read_ahead += any(s is not None and s.clock for s in stepper.next_spreads)
    assert read_ahead >= 3, "no step ended with the next epoch partly read"
    delivered = Counter(
        (int(s), int(i)) for step in whole for r in range(DP) for s, i, _ in zip(*_rank_rows(step, r)) if s >= 0
    )
    assert set(delivered.values()) == {4}  # every chunk once an epoch
    for at in range(1, len(whole)):
        first = _stepper(spec, lengths=lengths, late=0.3, seed=at)
        _run(first, at)
        assert first.state_dict("f") == states[at - 1], f"step {at - 1}'s position depends on the records' timing"
        resumed = _stepper(spec, lengths=lengths, late=0.3, seed=100 + at)
        resumed.load_state_dict(orjson.loads(orjson.dumps(first.state_dict("f"))))
        for a, state in zip(whole[at:], states[at:], strict=True):
            b = resumed.next_step()
            for x, y in zip(a.batches, b.batches, strict=True):
                assert all(np.array_equal(x[k], y[k]) for k in x), f"resumed at step {at}, step {a.number} differs"
            assert resumed.state_dict("f") == state, f"resumed at step {at}, step {a.number}'s position differs"
        assert resumed.next_step() is None


@pytest.mark.parametrize("tail", [0, 40 * SEQ])
def test_an_epoch_ending_in_nothing_to_draw_does_not_end_the_source(tail):
    # the epoch's last documents are empty (or dropped as too long): its window comes back empty
    spec = _spec(long_docs="drop", epochs=3, shuffle_window=4)
    lengths = [[30] * 20 + [tail] * 3, [30] * 5, [30] * 5]
    delivered = Counter()
    for step in _run(_stepper(spec, lengths=lengths), 10_000):
        for rank in range(DP):
            sources, _, _ = _rank_rows(step, rank)
            delivered.update(int(s) for s in sources if s >= 0)
    assert delivered == {0: 3 * 20, 1: 3 * 5, 2: 3 * 5}


@pytest.mark.parametrize("k", [0, 1, 9, 40])
def test_replaying_k_steps_from_a_snapshot_reaches_the_same_position(k):
    """What a checkpoint folder's resume does: restore a snapshot, plan k steps again."""
    spec = _spec()
    live = [(12, {"s0": 0.2, "s1": 0.2, "s2": 0.6})]  # a live change inside the replayed range
    direct = Stepper(spec, [ListIntake(i, heavy_tailed(i, 1500)) for i in range(3)], list(live))
    direct.dp = DP
    _run(direct, 10)
    snapshot = orjson.loads(orjson.dumps(direct.state_dict("f")))
    _run(direct, k)
    replayed = Stepper(spec, [ListIntake(i, heavy_tailed(i, 1500)) for i in range(3)])
    replayed.dp = DP
    replayed.load_state_dict({**snapshot, "live": [list(c) for c in live]})

    replayed.rehydrate()
    for _ in range(k):
        replayed.next_step(build=False)
    assert replayed.state_dict("f") == orjson.loads(orjson.dumps(direct.state_dict("f")))


def test_the_position_holds_no_tokens_and_stays_small():
    stepper = _stepper(_spec())
    sizes = []
    for _ in range(20):
        _run(stepper, 10)
        sizes.append(len(repr(stepper.state_dict("f"))))
    assert max(sizes) < 4000


def test_the_planner_keeps_a_documents_share_of_each_rank():
    from omniload.coordinator.plan.cost import cost_function
    from omniload.coordinator.plan.packer import Segment
    from omniload.coordinator.plan.step_plan import plan_step

    chunks = [Segment(0, k, SEQ, np.zeros(SEQ, np.int32), origin=(0, 5)) for k in range(3)]
    others = [Segment(1, 100 + k, 10, np.zeros(10, np.int32), origin=(0, k)) for k in range(4)]
    plan = plan_step([], chunks + others, 1, ROWS, SEQ, cost_function("tokens", (0, 1, 0), ["a", "b"]), doc_cap=SEQ)
    placed = [s.sample_id for row in plan.rows[0] for s in row]
    assert sum(1 for i in placed if i < 3) == 1 and len(placed) == 5
    assert sorted(s.sample_id for s in plan.carry) == [1, 2] and all(s.delay == 1 for s in plan.carry)
    assert plan.balance["carried"] == 2


class LateIntake(ListIntake):
    """ListIntake whose every third poll finds the ring empty, as when the worker is behind."""

    def __init__(self, index: int, lengths: list[int], epochs: int = 1) -> None:
        super().__init__(index, lengths, epochs)
        self.polls = self.empty = 0

    def poll(self, until_group: int | None = None) -> Doc | None:
        self.polls += 1
        if self.polls % 3 == 0 and not self.dry and (until_group is None or self.group < until_group):
            self.empty += 1
            return None
        return super().poll(until_group)


def test_records_that_arrive_late_are_waited_for_and_change_nothing():
    """The stepper takes a record that is there at once and waits for one that is not yet
    (_take, then _await_doc): the steps are the same either way, across an epoch's end too
    (a window stops at its epoch, not at a ring that is empty for a moment)."""
    spec = _spec(epochs=2)
    lengths = [heavy_tailed(i, 300) for i in range(3)]
    prompt = _run(_stepper(spec, lengths=lengths), 1000)
    late_intakes = [LateIntake(i, n, spec.epochs) for i, n in enumerate(lengths)]
    late_stepper = Stepper(spec, late_intakes)
    late_stepper.dp = DP
    late = _run(late_stepper, 1000)
    assert len(late) == len(prompt) > 10 and all(i.dry for i in late_intakes)
    assert sum(i.empty for i in late_intakes) > 100  # the waiting path ran, often
    for a, b in zip(prompt, late):
        assert a.tokens == b.tokens
        for x, y in zip(a.batches, b.batches):
            assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
