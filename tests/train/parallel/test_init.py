"""Initialization values, not only their grid independence: GPT-2's scales and a sound
normal generator (axonn_launch.train.parallel.init)."""

from __future__ import annotations

import math

import pytest
import torch

from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.train.models.gpt import GPT, full_state_dict
from axonn_launch.train.parallel.groups import single_process_groups
from axonn_launch.train.parallel.init import UNIFORMS, normal_at, parameter_key

SPEC = ModelSpec("init", n_layer=4, d_model=256, n_head=4, vocab_size=512, max_seq_len=64)


def test_draws_are_standard_normal_up_to_the_irwin_hall_tails():
    values = normal_at(parameter_key(7, "w"), torch.arange(1 << 20, dtype=torch.int64), 1.0)
    n = values.numel()
    assert values.dtype == torch.float32
    assert abs(values.mean().item()) < 4 / math.sqrt(n)
    assert values.std().item() == pytest.approx(1.0, rel=4e-3)
    # the sum of 8 uniforms: excess kurtosis -6/(5*8), support |x| < sqrt(3*8)
    excess = (values.double() ** 4).mean().item() / values.double().var().item() ** 2 - 3
    assert excess == pytest.approx(-6 / (5 * UNIFORMS), abs=0.02)
    assert values.abs().max().item() < math.sqrt(3 * UNIFORMS)
    # streams of different parameters are uncorrelated
    other = normal_at(parameter_key(7, "v"), torch.arange(n, dtype=torch.int64), 1.0)
    assert abs(torch.corrcoef(torch.stack([values, other]))[0, 1].item()) < 4 / math.sqrt(n)


def test_every_parameter_has_gpt2s_scale():
    groups = single_process_groups()
    model = GPT(SPEC, groups=groups, overlap=OverlapConfig())
    state = full_state_dict(model, groups)
    residual = 0.02 / math.sqrt(2 * SPEC.n_layer)
    checked = set()
    for name, tensor in state.items():
        if name.endswith(".bias"):
            assert torch.count_nonzero(tensor) == 0, name
        elif ".ln" in name or name.startswith("ln_"):
            assert torch.all(tensor == 1), name
        else:
            want = residual if name.endswith(("attn.proj.weight", "mlp.down.weight")) else 0.02
            assert tensor.std().item() == pytest.approx(want, rel=0.03), name
            assert abs(tensor.mean().item()) < 5 * want / math.sqrt(tensor.numel()), name
            checked.add(want)
        assert torch.isfinite(tensor).all(), name
    assert checked == {0.02, residual}  # both scales occur
