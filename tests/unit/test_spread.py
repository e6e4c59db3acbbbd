"""A source's spread alone: every unit once, an order that depends on the documents and the seed
only, long documents spread over the horizon, the cap, and restore from a position."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from omniload.coordinator.plan.documents import Doc
from omniload.coordinator.plan.packer import doc_key
from omniload.coordinator.plan.spread import MemoryStore, Spread, SpreadPosition

SEQ = 16
_NO_CAP = 1 << 60


def _docs(lengths, source=0):
    """Documents in reading order: document i at position (0, i), its tokens i*1000 + 0.. (to tell them apart)."""
    return [Doc(source, i, (np.arange(n) % 60000).astype(np.uint16), 0, i) for i, n in enumerate(lengths)]


def _spread(horizon, seed=0, store=None, position=None, bucket_rows=0, fill=0):
    return Spread(0, seed, horizon, fill, store or MemoryStore(), SEQ, 1, bucket_rows=bucket_rows, position=position)


class _Reader:
    """The stepper's part: add the next document while no unit is due, end() at the epoch's end."""

    def __init__(self, spread, docs, taken=0):
        self.spread, self.docs, self.taken = spread, docs, taken

    def draw(self, in_step, cap):
        """The next unit; None once the spread is used up."""
        while not self.spread.ready():
            if self.spread.exhausted:
                return None
            self._read()
        for _ in range(64):  # as the stepper: read on for a unit under the cap, then give way
            if (unit := self.spread.draw(in_step, cap, give_way=False)) is not None or self.spread.ended:
                break
            self._read()
        return unit or self.spread.draw(in_step, cap)

    def _read(self):
        if self.taken < len(self.docs):
            self.spread.add(self.docs[self.taken])
            self.taken += 1
        else:
            self.spread.end()

    def cursor(self):
        return (0, self.taken) if self.taken < len(self.docs) else (1, 0)


def _drain(reader, per_step, cap, in_step=None, steps=None):
    """Draw steps of `per_step` units with the cap until the spread is used up (or `steps`)."""
    out = []
    while steps is None or len(out) < steps:
        in_step, drawn = in_step if in_step is not None else {}, []
        for _ in range(per_step):
            unit = reader.draw(in_step, cap)
            if unit is None:
                return out + [drawn] if drawn else out
            in_step[doc_key(unit[0])] = in_step.get(doc_key(unit[0]), 0) + sum(s.length for s in unit)
            drawn.append(unit)
        out.append(drawn)
        in_step = None
    return out


def _ids(units):
    return [s.sample_id for unit in units for s in unit]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12 * SEQ), min_size=1, max_size=40),
    per_step=st.integers(1, 9),
    cap=st.integers(1, 4 * SEQ),
    horizon=st.integers(1, 40 * SEQ),
    seed=st.integers(0, 3),
)
def test_every_unit_is_drawn_exactly_once_whatever_the_cap_and_horizon(lengths, per_step, cap, horizon, seed):
    docs = _docs(lengths)
    store = MemoryStore()
    steps = _drain(_Reader(_spread(horizon, seed, store), docs), per_step, cap)
    drawn = [u for step in steps for u in step]
    expected = sorted((d.ordinal << 12) + c for d in docs for c in range(-(-len(d.tokens) // SEQ)))
    assert sorted(_ids(drawn)) == expected
    for unit in drawn:  # each unit's tokens are its document's, where they belong
        for segment in unit:
            chunk = segment.sample_id & 0xFFF
            assert np.array_equal(segment.tokens, docs[segment.sample_id >> 12].tokens[chunk * SEQ :][: segment.length])
    assert store.held_bytes == 0  # nothing waits once everything is drawn


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 10 * SEQ), min_size=2, max_size=40), horizon=st.integers(1, 30 * SEQ))
def test_the_order_does_not_depend_on_how_reading_and_drawing_interleave(lengths, horizon):
    """Reading every document first, or each only once the draws need it, gives one order:
    a unit is drawn only when no document still unread could come before it."""
    docs = _docs(lengths)
    lazy = _ids(u for step in _drain(_Reader(_spread(horizon), docs), 3, _NO_CAP) for u in step)
    eager_spread = _spread(horizon)
    for doc in docs:
        eager_spread.add(doc)
    eager_spread.end()
    eager = _ids(u for step in _drain(_Reader(eager_spread, docs, len(docs)), 3, _NO_CAP) for u in step)
    assert lazy == eager


def test_the_order_is_seeded_by_seed_and_source():
    docs = _docs([40, 3, 200, 7, 16, 90, 5, 5, 5])
    order = _ids(u for s in _drain(_Reader(_spread(400, seed=1), docs), 4, _NO_CAP) for u in s)
    assert order == _ids(u for s in _drain(_Reader(_spread(400, seed=1), docs), 4, _NO_CAP) for u in s)
    assert order != _ids(u for s in _drain(_Reader(_spread(400, seed=2), docs), 4, _NO_CAP) for u in s)


def test_a_long_documents_chunks_are_spread_evenly_over_the_horizon():
    # one document of 60 chunks among 1,800 short ones (10,000 tokens), read once the spread is
    # under way: its chunks spread over the steps of the horizon of 4,000 tokens
    docs = _docs([5] * 1000 + [60 * SEQ] + [5] * 800)
    steps = _drain(_Reader(_spread(4000), docs), 12, cap=SEQ)
    long_per_step = [sum(1 for u in step if u[0].origin == (0, 1000)) for step in steps]
    assert max(long_per_step) == 1  # the cap: one chunk of it a step
    assert sum(long_per_step) == 60
    at = np.flatnonzero(long_per_step)
    horizon_steps = 4000 / (12 * 5.5)  # steps of about 12 units of 5.5 tokens cover the horizon
    assert at[-1] - at[0] >= 0.8 * horizon_steps  # over the horizon, not a few steps
    assert np.diff(at).max() <= 3 * horizon_steps / 60  # evenly, not bunched


def test_a_million_token_documents_chunks_land_evenly_across_the_horizon_seeded():
    """One document of 2**20 tokens (4,096 chunks of 256) read among 2,000 short ones, an epoch
    within the fill (the default's case up to 2**27 tokens): its chunks are drawn all over the
    epoch, about its share of the tokens (62%) in every tenth of what is drawn, in an order set
    by the seed alone. (Read past the fill, a document spreads over the horizon from where it
    was read: test_a_long_documents_chunks_are_spread_evenly_over_the_horizon.)"""
    seq, length = 256, 1 << 20
    docs = [Doc(0, i, np.zeros(300, np.uint16), 0, i) for i in range(1000)]
    docs += [Doc(0, 1000, np.zeros(length, np.uint16), 0, 1000)]
    docs += [Doc(0, 1001 + i, np.zeros(300, np.uint16), 0, 1001 + i) for i in range(1000)]

    def order(seed):
        spread = Spread(0, seed, 2 * length, 2 * length, MemoryStore(), seq, 1)
        return [u[0] for s in _drain(_Reader(spread, docs), 64, _NO_CAP) for u in s]

    drawn = order(0)
    long_chunks = [u.sample_id for u in drawn if u.origin == (0, 1000)]
    assert len(long_chunks) == length // seq
    tokens = np.array([u.length for u in drawn])
    is_long = np.array([u.origin == (0, 1000) for u in drawn])
    tenth = np.minimum(10 * np.cumsum(tokens) // (tokens.sum() + 1), 9)
    shares = [tokens[(tenth == t) & is_long].sum() / tokens[tenth == t].sum() for t in range(10)]
    assert min(shares) > 0.5 and max(shares) < 0.75, shares
    assert [u.sample_id for u in order(0)] == [u.sample_id for u in drawn]
    assert [u.sample_id for u in order(1) if u.origin == (0, 1000)] != long_chunks


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_cap_keeps_a_long_document_read_first_from_filling_the_first_steps(seed):
    """Read first, a long document is all there is to draw; the draws read on for others (up
    to 64 documents, then the cap gives way: seed 0 gives way once). Without the cap, whole
    steps of 12 units are its chunks."""
    docs = _docs([60 * SEQ] + [5] * 1800)
    steps = _drain(_Reader(_spread(4000, seed), docs), 12, cap=SEQ)
    per_step = [sum(1 for u in step if u[0].origin == (0, 0)) for step in steps]
    assert max(per_step) <= 2 and sum(n > 1 for n in per_step) <= 1, per_step
    assert sum(per_step) == 60


def test_a_horizon_longer_than_the_epoch_shuffles_the_whole_epoch():
    """The first tenth of the draws come from all over the reading order."""
    docs = _docs([8] * 2000)
    drawn = [u[0].origin[1] for s in _drain(_Reader(_spread(1 << 20), docs), 10, _NO_CAP) for u in s]
    first = np.array(drawn[:200])
    assert first.min() < 200 and first.max() > 1800
    assert abs(np.corrcoef(np.arange(len(drawn)), drawn)[0, 1]) < 0.1


def test_the_fill_is_read_before_the_first_draw_and_its_documents_come_from_all_over_it():
    """An epoch's first `fill` tokens are a shuffle of their own: the first draw waits for them,
    and the first draws come from the whole fill, not from the documents read first."""
    docs = _docs([8] * 2000)  # 16,000 tokens; a fill of 4,000 is the first 500 documents
    reader = _Reader(_spread(8000, fill=4000), docs)
    first = reader.draw({}, _NO_CAP)
    assert reader.taken >= 500
    drawn = [first[0].origin[1]] + [u[0].origin[1] for s in _drain(reader, 10, _NO_CAP, steps=10) for u in s]
    assert min(drawn) < 100 and max(drawn) > 400  # the first 100 draws span the fill


def test_an_epoch_within_the_fill_is_one_global_shuffle():
    docs = _docs([8] * 2000)
    drawn = [u[0].origin[1] for s in _drain(_Reader(_spread(1000, fill=1 << 20), docs), 10, _NO_CAP) for u in s]
    assert sorted(drawn) == list(range(2000))
    for part in (drawn[:200], drawn[-200:]):  # the first and the last draws alike: from all over the epoch
        assert min(part) < 100 and max(part) > 1900
    assert abs(np.corrcoef(np.arange(2000), drawn)[0, 1]) < 0.1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_neighbours_in_the_shuffle_are_no_lattice_of_the_reading_order(seed):
    """A document's key and its chunks' order must not be a near-linear function of where it
    was read: with such a hash, the documents drawn one after another were a fixed few
    positions apart in the reading order (five distinct gaps among 1,999), neighbouring
    documents of sorted files drawn together. A random order has some 1,500."""
    docs = _docs([8] * 2000)
    drawn = [u[0].origin[1] for s in _drain(_Reader(_spread(1000, seed, fill=1 << 20), docs), 10, _NO_CAP) for u in s]
    assert len(set(np.diff(drawn).tolist())) > 1000
    (long_doc,) = _docs([600 * SEQ])  # 600 chunks: their order computed with numpy, not in Python
    reader = _Reader(_spread(1 << 20, seed, fill=1 << 20), [long_doc])
    chunks = [u[0].sample_id & 0xFFF for s in _drain(reader, 10, _NO_CAP) for u in s]  # the chunk index
    assert sorted(chunks) == list(range(600)) and len(set(np.diff(chunks).tolist())) > 250


def test_a_short_horizon_keeps_units_near_where_they_were_read():
    docs = _docs([8] * 2000)
    drawn = [u[0].origin[1] for s in _drain(_Reader(_spread(8 * 20), docs), 10, _NO_CAP) for u in s]
    assert max(abs(i - d) for i, d in enumerate(drawn)) <= 40  # a delay of at most the horizon, 20 documents


def test_when_only_one_document_is_left_the_cap_gives_way():
    steps = _drain(_Reader(_spread(1000), _docs([10 * SEQ])), 4, cap=SEQ)
    assert [len(step) for step in steps] == [4, 4, 2]


def test_bucketed_units_wait_and_come_back_whole():
    docs = _docs([5 * SEQ + 3, 7, 2 * SEQ])
    drawn = [u for s in _drain(_Reader(_spread(100, bucket_rows=2), docs), 2, _NO_CAP) for u in s]
    assert sorted(len(u) for u in drawn) == [1, 2, 2, 2, 2]  # 6 chunks in 3 units; 1; 2 chunks in 1
    for unit in drawn:
        assert [s.position_start for s in unit] == [k * SEQ for k in range(len(unit))]
        assert len({s.group for s in unit}) == 1


@settings(max_examples=50, deadline=None)
# slots of drawn documents reused while an older one still waits
@example(lengths=[40 * SEQ] + [3] * 60, stop=6, per_step=5, cap=_NO_CAP, horizon=2000)
@given(
    lengths=st.lists(st.integers(1, 8 * SEQ), min_size=2, max_size=60),
    stop=st.integers(0, 12),
    per_step=st.integers(1, 6),
    cap=st.integers(1, 3 * SEQ),
    horizon=st.integers(1, 20 * SEQ),
)
def test_a_restored_spread_draws_what_the_original_would(lengths, stop, per_step, cap, horizon):
    """Save a position after some steps (as JSON, as a checkpoint holds it), make a spread from
    it, read the documents from its start to the cursor again: the draws go on unchanged."""
    docs = _docs(lengths)
    original = _Reader(_spread(horizon), docs)
    _drain(original, per_step, cap, steps=stop)
    cursor = original.cursor()
    position = SpreadPosition.from_json(json.loads(json.dumps(original.spread.position(cursor).to_json())))
    twin = _spread(1, position=position)  # the position's horizon wins
    first = position.start[1] if position.start[0] == 0 else len(docs)
    for doc in docs[first : original.taken]:
        twin.add(doc)
    twin.restored()
    if original.spread.ended:
        twin.end()
    twin_reader = _Reader(twin, docs, original.taken)
    rest = [_ids(s) for s in _drain(original, per_step, cap)]
    assert rest == [_ids(s) for s in _drain(twin_reader, per_step, cap)]


def test_a_position_is_a_few_plain_ints_and_a_malformed_one_is_named():
    reader = _Reader(_spread(500), _docs([3 * SEQ, 5, 5, 40]))
    _drain(reader, 2, _NO_CAP, steps=1)
    saved = reader.spread.position(reader.cursor()).to_json()
    assert json.loads(json.dumps(saved)) == saved
    assert set(saved) == {"start", "clock", "horizon", "fill", "frontier", "passed", "ended", "drawn_since_end"}
    with pytest.raises(ValueError, match="horizon"):
        SpreadPosition.from_json({k: v for k, v in saved.items() if k != "horizon"})
    with pytest.raises(ValueError, match="out of range"):
        SpreadPosition.from_json({**saved, "clock": -1})


class _NoStore:
    """A store that keeps nothing: what the spread itself holds, measured alone."""

    def put(self, parts, units):
        return 0

    def read(self, handle, offset, size):
        return b""

    def release(self, handle):
        pass


@pytest.mark.parametrize("length, limit", [(300, 200), (30 * SEQ, 100)])
def test_a_spread_holds_a_few_ints_a_waiting_unit(length, limit):
    """docs/planning.md states the coordinator's memory per waiting unit: 140 bytes for a
    document of one unit, 80 a unit for a longer one (their tokens wait in the store)."""
    import tracemalloc

    docs = [Doc(0, i, np.zeros(length, np.uint16), i // 1000, i % 1000) for i in range(4000)]
    spread = Spread(0, 1, 1 << 40, 0, _NoStore(), SEQ if length > SEQ else 512, epoch_end=10**9)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for doc in docs:
        spread.add(doc)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held / spread.waiting_units < limit
