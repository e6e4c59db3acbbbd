"""--cost-model: a model's shape to the coefficients of its training FLOPs per segment."""

import pytest

from omniload.errors import ConfigError
from omniload.model_shape import PRESETS, ModelShape, parse_model_shape
from omniload.spec import Spec


def _flops_by_hand(length: int, layers: int, h: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> float:
    """Training FLOPs of one causal document, counted matrix by matrix, token by token."""
    head_dim = h // heads
    q, k, v, o = h * h, h * kv_heads * head_dim, h * kv_heads * head_dim, h * h
    gate, up, down = h * ffn, h * ffn, ffn * h
    per_token = 2 * (layers * (q + k + v + o + gate + up + down) + h * vocab)  # a multiply and an add per weight
    attention = sum(layers * 2 * (2 * h * (i + 1)) for i in range(length))  # token i: QK^T and AV over i+1 keys
    return 3 * (per_token * length + attention)  # backward: twice the forward


@pytest.mark.parametrize("length", [1, 7, 100, 4096])
@pytest.mark.parametrize("name", ["llama-1b", "llama-8b", "llama-70b"])
def test_the_coefficients_are_the_training_flops_of_a_causal_document(name, length):
    shape = PRESETS[name]
    a, b, c, d = shape.cost_coeffs()
    expected = _flops_by_hand(length, shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab)
    assert a * length**2 + b * length + c == pytest.approx(expected, rel=1e-12)
    assert d == 256 * 3 * shape.linear_flops  # an image: what 256 tokens cost the matrices


def test_a_one_billion_model_costs_about_six_times_its_parameters_a_token():
    a, b, _, _ = PRESETS["llama-1b"].cost_coeffs()
    assert b == pytest.approx(6 * 1.24e9, rel=0.02)  # 1.24B parameters without the embedding lookup
    # attention costs as much as the matrices at about b/a tokens a document: ~38k for the 1B; a
    # wider model spends more on its matrices (b grows as hidden^2, a as hidden): ~106k for the 70B
    assert 30_000 < b / a < 45_000
    a70, b70, _, _ = PRESETS["llama-70b"].cost_coeffs()
    assert 100_000 < b70 / a70 < 115_000


def test_the_shape_parses_from_text_and_names_what_is_wrong():
    shape = parse_model_shape("layers=16,hidden=2048,heads=32,ffn=8192,vocab=128256,kv_heads=8")
    assert shape == PRESETS["llama-1b"]
    assert parse_model_shape("layers=2,hidden=64,heads=4,ffn=256,vocab=256").kv_heads == 0
    with pytest.raises(ConfigError, match="missing: vocab"):
        parse_model_shape("layers=16,hidden=2048,heads=32,ffn=8192")
    with pytest.raises(ConfigError, match="preset.*llama-1b"):
        parse_model_shape("llama-7b")
    with pytest.raises(ConfigError, match="hidden must be an integer"):
        parse_model_shape("layers=16,hidden=wide,heads=32,ffn=8192,vocab=1")
    with pytest.raises(ConfigError, match="multiple of heads"):
        ModelShape(layers=1, hidden=100, heads=3, ffn=1, vocab=1)


def test_the_spec_takes_the_cost_from_the_model_from_flags_files_and_python():
    spec = Spec.from_dict({"sources": ["a=x"], "cost_model": "llama-8b"})
    assert spec.cost_coeffs == PRESETS["llama-8b"].cost_coeffs()
    assert Spec.from_dict(spec.to_dict()) == spec  # as the launcher hands it to the coordinator
    with pytest.raises(ConfigError, match="both set the cost: give one"):
        Spec.from_dict({"sources": ["a=x"], "cost_model": "llama-8b", "cost_coeffs": "1,2,3"})
    with pytest.raises(ConfigError, match="needs --balance attention"):
        Spec.from_dict({"sources": ["a=x"], "cost_model": "llama-8b", "balance": "tokens"})
