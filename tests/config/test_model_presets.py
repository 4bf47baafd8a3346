"""Model presets: parameter counts computed from the shape."""

import pytest

from axonn_launch.config.compose import load

# Parameter counts from the AxoNN reference table (axonn.md 5.3, Megatron's get_params,
# V=50304, s=2048), in billions.
PAPER_COUNTS = {
    "gpt_5b": 5.05,
    "gpt_10b": 10.34,
    "gpt_20b": 20.11,
    "gpt_40b": 39.22,
    "gpt_60b": 57.57,
    "gpt_80b": 76.75,
    "gpt_160b": 152.86,
}


@pytest.mark.parametrize("name", sorted(PAPER_COUNTS))
def test_paper_shapes_reproduce_the_reference_counts(name):
    model = load([f"model={name}"]).model
    assert model.n_params() / 1e9 == pytest.approx(PAPER_COUNTS[name], abs=0.006)


@pytest.mark.parametrize("name,target", [("gpt_320b", 320e9), ("gpt_640b", 640e9)])
def test_large_presets_are_within_three_percent_of_their_name(name, target):
    model = load([f"model={name}"]).model
    assert abs(model.n_params() - target) / target < 0.03
    assert model.head_dim == 128


def test_count_matches_megatron_closed_form():
    m = load(["model=gpt_20b"]).model
    l, h, v, s = m.n_layer, m.d_model, m.vocab_size, m.max_seq_len
    closed = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    assert m.n_params() == pytest.approx(closed + 2 * h, rel=1e-12)


def test_flops_per_token_matches_narayanan_formula():
    m = load(["model=gpt_5b"]).model
    assert m.flops_per_token(2048, recompute=True) / 1e9 == pytest.approx(43.1, abs=0.05)
    ratio = m.flops_per_token(2048, recompute=False) / m.flops_per_token(2048, recompute=True)
    assert 0.74 < ratio < 0.76  # 3 passes instead of 4


def test_tiny_model_is_tiny():
    m = load([]).model
    assert m.name == "gpt_tiny" and m.n_params() < 200_000
