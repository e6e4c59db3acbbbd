import numpy as np
import pytest

from omniload.coordinator.mixture import next_source, shares


def _draw(weights, lengths_by_source, n, until_tokens=None):
    tokens = [0] * len(weights)
    picks = []
    for i in range(n):
        if until_tokens and sum(tokens) >= until_tokens:
            break
        s = next_source(tokens, weights, [True] * len(weights))
        tokens[s] += lengths_by_source[s][i % len(lengths_by_source[s])]
        picks.append(s)
    return tokens, picks


def test_token_shares_track_weights_whatever_the_document_lengths():
    rng = np.random.default_rng(0)
    lengths = [rng.integers(10, 3000, 500).tolist(), rng.integers(1, 50, 500).tolist(), [8000, 20000]]
    weights = [0.6, 0.3, 0.1]
    for budget in (50_000, 2_000_000):
        tokens, _ = _draw(weights, lengths, 10**7, until_tokens=budget)
        # the share of each source is off by at most one (longest) document at any point
        assert shares(tokens) == pytest.approx(weights, abs=20000 / sum(tokens))


def test_choices_are_a_function_of_weights_and_lengths():
    lengths = [[5, 7, 100], [3], [50, 1]]
    assert _draw([0.5, 0.2, 0.3], lengths, 200) == _draw([0.5, 0.2, 0.3], lengths, 200)


def test_dry_and_zero_weight_sources_are_never_chosen():
    assert next_source([0, 0, 0], [0.5, 0.0, 0.5], [False, True, True]) == 2
    assert next_source([0, 0], [0.5, 0.5], [False, False]) is None
