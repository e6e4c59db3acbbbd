import pytest

from omniload.coordinator.plan.schedule import in_force, weights_at
from omniload.errors import ConfigError
from omniload.spec import Phase, Spec

NAMES = ["web", "code", "books"]
BASE = [1 / 3] * 3
PHASES = (
    Phase(until_step=1000, weights={"web": 0.8, "code": 0.2}),
    Phase(until_step=5000, ramp="linear", weights={"web": 0.5, "code": 0.3, "books": 0.2}),
)


def test_piecewise_constant_then_linear_ramp_then_hold():
    at = lambda step: weights_at(PHASES, BASE, NAMES, step, 0)  # noqa: E731
    assert at(0) == pytest.approx([0.8, 0.2, 0.0])
    assert at(999) == pytest.approx([0.8, 0.2, 0.0])
    assert at(1000) == pytest.approx([0.8, 0.2, 0.0])  # the ramp starts where phase 1 ended
    assert at(3000) == pytest.approx([0.65, 0.25, 0.1])
    assert at(5000) == pytest.approx([0.5, 0.3, 0.2])
    assert at(10**6) == pytest.approx([0.5, 0.3, 0.2])


def test_phases_over_tokens():
    phases = (Phase(until_tokens=10_000, weights={"web": 1.0}), Phase(until_tokens=20_000, weights={"code": 1.0}))
    assert weights_at(phases, BASE, NAMES, 7, 9_999) == [1.0, 0.0, 0.0]
    assert weights_at(phases, BASE, NAMES, 7, 10_000) == [0.0, 1.0, 0.0]


def test_live_changes_apply_from_their_step_and_replay_the_same():
    live = [(40, {"web": 0.4, "code": 0.3, "books": 0.3})]
    assert weights_at(PHASES, BASE, NAMES, 39, 0, live) == pytest.approx([0.8, 0.2, 0.0])
    assert weights_at(PHASES, BASE, NAMES, 40, 0, live) == pytest.approx([0.4, 0.3, 0.3])
    assert weights_at(PHASES, BASE, NAMES, 4000, 0, live) == pytest.approx([0.4, 0.3, 0.3])


def test_only_the_changes_in_force_are_kept_and_they_decide_the_same_weights():
    live = [(10, {"web": 1.0}), (20, {"code": 1.0}), (20, {"books": 1.0}), (30, {"web": 0.5, "code": 0.5})]
    assert in_force(live, 5) == live
    assert in_force(live, 25) == live[2:]  # the later of two changes at one step wins
    assert in_force(live, 30) == live[3:]
    for step in range(0, 40):
        kept = in_force(live, step)
        for later in range(step, 40):
            assert weights_at(PHASES, BASE, NAMES, later, 0, kept) == weights_at(PHASES, BASE, NAMES, later, 0, live)


def test_no_schedule_means_the_source_weights():
    assert weights_at((), [0.6, 0.3, 0.1], NAMES, 123, 456) == pytest.approx([0.6, 0.3, 0.1])


@pytest.mark.parametrize(
    "mixture, message",
    [
        ([{"until_step": 10, "weights": {"nope": 1}}], "unknown source"),
        ([{"until_step": 10, "until_tokens": 5, "weights": {"a": 1}}], "exactly one of"),
        ([{"until_step": 10, "weights": {"a": 1}}, {"until_tokens": 20, "weights": {"a": 1}}], "not both"),
        ([{"until_step": 10, "weights": {"a": 1}}, {"until_step": 5, "weights": {"a": 1}}], "must increase"),
        ([{"until_step": 10, "weights": {"a": 0}}], "all zero"),
        ([{"until_step": 10, "weights": {"a": 1}, "ramp": "cubic"}], "ramp must be one of"),
    ],
)
def test_bad_schedules(mixture, message):
    with pytest.raises(ConfigError, match=message):
        Spec.from_dict({"sources": ["a=x"], "mixture": mixture})
