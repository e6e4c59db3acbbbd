import numpy as np
import pytest

from omniload.coordinator.plan.mixture import StrideQueue, advance, join, next_source


def shares(tokens):
    return [t / sum(tokens) for t in tokens]


def _draw(weights, lengths_by_source, until_tokens, passes=None, tokens=None):
    passes = passes if passes is not None else [0.0] * len(weights)
    tokens = tokens if tokens is not None else [0] * len(weights)
    picks, i = [], 0
    while sum(tokens) < until_tokens:
        s = next_source(passes, weights, [True] * len(weights))
        n = lengths_by_source[s][i % len(lengths_by_source[s])]
        advance(passes, s, n, weights)
        tokens[s] += n
        picks.append(s)
        i += 1
    return tokens, picks


def test_token_shares_track_weights_whatever_the_document_lengths():
    rng = np.random.default_rng(0)
    lengths = [rng.integers(10, 3000, 500).tolist(), rng.integers(1, 50, 500).tolist(), [8000, 20000]]
    weights = [0.6, 0.3, 0.1]
    for budget in (50_000, 2_000_000):
        tokens, _ = _draw(weights, lengths, budget)
        # the share of each source is off by at most one (longest) document at any point
        assert shares(tokens) == pytest.approx(weights, abs=20000 / sum(tokens))


def test_choices_are_a_function_of_weights_and_lengths():
    lengths = [[5, 7, 100], [3], [50, 1]]
    assert _draw([0.5, 0.2, 0.3], lengths, 5000) == _draw([0.5, 0.2, 0.3], lengths, 5000)


def test_dry_and_zero_weight_sources_are_never_chosen():
    assert next_source([0, 0, 0], [0.5, 0.0, 0.5], [False, True, True]) == 2
    assert next_source([0, 0], [0.5, 0.5], [False, False]) is None


def test_a_source_that_gets_a_weight_joins_without_a_burst():
    lengths = [[100], [100], [100]]
    passes, tokens = [0.0] * 3, [0] * 3
    _draw([0.5, 0.5, 0.0], lengths, 100_000, passes, tokens)
    join(passes, [0.5, 0.5, 0.0], [0.4, 0.4, 0.2])
    before = list(tokens)
    _, picks = _draw([0.4, 0.4, 0.2], lengths, 110_000, passes, tokens)
    # the newcomer gets its 20% share of what follows, not everything until it "catches up"
    new = [t - b for t, b in zip(tokens, before)]
    assert shares(new) == pytest.approx([0.4, 0.4, 0.2], abs=0.02)
    assert picks[:5].count(2) <= 2


def test_the_stride_queue_chooses_as_next_source_does():
    """The planner's queue must draw the sources next_source would, ties and ended sources included."""
    rng = np.random.default_rng(7)
    weights = [0.3, 0.0, 0.3, 0.25, 0.15]
    passes, queue_passes = [5.0, 0.0, 5.0, 1.0, 0.0], [5.0, 0.0, 5.0, 1.0, 0.0]
    live = [True, True, True, True, False]
    queue, picks = StrideQueue(queue_passes, weights, live), []
    for i in range(2000):
        s = next_source(passes, weights, live)
        assert queue.peek() == s
        if s is None:
            break
        if i in (500, 1200):  # the source ends: its window came back empty
            live[s] = False
            queue.drop()
            continue
        n = int(rng.choice([10, 10, 20, 700]))  # equal lengths make ties
        advance(passes, s, n, weights)
        queue.advance(n)
        picks.append(s)
    assert queue_passes == passes
    assert len(set(picks)) == 3 and 1 not in picks and 4 not in picks
