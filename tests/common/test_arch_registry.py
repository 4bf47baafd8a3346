"""An architecture is one strategy object (``common/arch``) and one torch module
(``train/models/registry.py``) under the same name, with a preset and tests.

A third architecture registered through the two registries alone (GPT with half the MLP
width) reaches the memory estimate, the traffic, the step time and the job side, which
differ from GPT's where its rule does. A contract check finds what a registered
architecture lacks, and finds it for an architecture registered without the rest.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from axonn_launch.common.arch import ARCHITECTURES, Architecture, register
from axonn_launch.common.arch.gpt import GPTArchitecture
from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import Hardware
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig, TrainConfig
from axonn_launch.common.traffic import block_collectives
from axonn_launch.cost.memory import estimate_memory, layer_activation_bytes, local_param_elements
from axonn_launch.cost.perf import step_time
from axonn_launch.train.models.gpt import GPT
from axonn_launch.train.models.registry import MODELS, build_model, register_model
from axonn_launch.train.parallel.groups import single_process_groups

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "axonn_launch" / "conf" / "model"
TOY = "gpt_half_mlp"
SHAPE = dict(n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=32)
TRAIN = TrainConfig(global_batch=8, micro_batch=4, seq_len=32, activation_checkpointing=False)
GRID = Grid(x=2, y=2, z=2)
HW = Hardware(gpus_per_node=8, gpu_model="A100", mem_per_gpu_gb=40, peak_tflops_per_gpu=1.0,
              intra_node_gbps=100, inter_node_gbps=25, latency_us=5)  # fmt: skip


class HalfMLP(GPTArchitecture):
    """GPT whose MLP has half GPT's units: (ffn_mult * h) / 2."""

    name = TOY

    def mlp_width(self, model) -> int:
        return model.ffn_hidden or model.ffn_mult * model.d_model // 2


class HalfMLPGPT(GPT):
    """The job side of the toy: GPT's module, whose MLP reads ``spec.d_ff``."""


@pytest.fixture(scope="module")
def toy():
    """The toy registered through the two registries, removed after this module."""
    register(HalfMLP())
    register_model(TOY, HalfMLPGPT)
    yield ModelSpec("toy", arch=TOY, **SHAPE)
    MODELS.pop(TOY)
    ARCHITECTURES.pop(TOY)


def missing_parts(name: str) -> list[str]:
    """What the architecture ``name`` lacks of strategy, torch module, preset and tests."""
    missing = [] if isinstance(ARCHITECTURES.get(name), Architecture) else ["strategy"]
    missing += [] if name in MODELS else ["torch module"]
    presets = [p.stem for p in PRESETS.glob("*.yaml") if preset_arch(p) == name]
    missing += [] if presets else ["preset"]
    named = [f'arch="{name}"', f"arch={name}", *presets]
    tests = [
        path
        for path in (ROOT / "tests").rglob("test_*.py")
        if path.name != Path(__file__).name and any(n in path.read_text() for n in named)
    ]
    return missing + ([] if tests else ["tests"])


def preset_arch(path: Path) -> str:
    model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
    return model.get("arch", ModelSpec.arch)


def smallest_preset(name: str) -> ModelSpec:
    specs = []
    for path in PRESETS.glob("*.yaml"):
        fields = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        if preset_arch(path) == name and fields.get("n_layer"):
            specs.append(ModelSpec(**fields))
    return min(specs, key=lambda spec: spec.n_params())


# --------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_registered_architecture_has_its_four_parts(name):
    assert missing_parts(name) == []


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_strategy_counts_the_parameters_its_module_builds(name):
    """On one rank the module holds every parameter: the strategy's count and its local
    share (small parameters included) must be what the module builds."""
    spec = smallest_preset(name)
    model = build_model(spec, groups=single_process_groups(), overlap=OverlapConfig())
    built = sum(p.numel() for p in model.parameters())
    assert built == spec.n_params() == local_param_elements(spec, Grid())


def test_the_contract_finds_what_a_strategy_alone_lacks(toy):
    MODELS.pop(TOY)
    try:
        assert missing_parts(TOY) == ["torch module", "preset", "tests"]
    finally:
        register_model(TOY, HalfMLPGPT)
    assert missing_parts(TOY) == ["preset", "tests"]
    with pytest.raises(ValueError, match="'gpt_half_mlp': empty or already registered"):
        register(HalfMLP())
    with pytest.raises(ValueError, match="'unknown': no strategy registered"):
        register_model("unknown", HalfMLPGPT)


# --------------------------------------------------------------------------- the toy's reach


def test_the_toy_shape_has_half_the_mlp(toy):
    gpt = ModelSpec("gpt", **SHAPE)
    assert (toy.d_ff, gpt.d_ff) == (128, 256)
    h, l, f_gpt, f_toy = 64, 2, 256, 128
    assert gpt.n_params() - toy.n_params() == l * (2 * h * (f_gpt - f_toy) + (f_gpt - f_toy))
    s = TRAIN.seq_len  # four passes with recompute: 2 FLOPs per weight each
    delta = 4 * l * 2 * 2 * h * (f_gpt - f_toy)
    assert gpt.flops_per_token(s, recompute=True) - toy.flops_per_token(s, recompute=True) == delta


def test_the_memory_estimate_uses_the_toy(toy):
    gpt = ModelSpec("gpt", **SHAPE)
    ours, theirs = (estimate_memory(model=m, grid=GRID, train=TRAIN) for m in (toy, gpt))
    assert ours.terms["parameters"] == local_param_elements(toy, GRID) * 4
    # MLP weights (2*h*f/(x*y), split over z) and biases (f/y) shrink with f
    less = 2 * (2 * 64 * 128 / 4 / 2 + 128 / 2)
    assert theirs.terms["parameters"] - ours.terms["parameters"] == less * 4
    tokens = TRAIN.micro_batch / GRID.z * TRAIN.seq_len  # the GeLU input and output, fp32
    fewer = tokens * 2 * (256 - 128) * 4 / GRID.y
    assert (
        layer_activation_bytes(gpt, GRID, tokens) - layer_activation_bytes(toy, GRID, tokens)
        == fewer
    )
    assert theirs.terms["activations"] - ours.terms["activations"] == 2 * fewer
    assert ours.total < theirs.total


def test_the_traffic_uses_the_toy(toy):
    gpt = ModelSpec("gpt", **SHAPE)
    ours, theirs = (block_collectives(m, GRID, TRAIN, on_gpu=True) for m in (toy, gpt))
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs):
        assert (mine.op, mine.axis, mine.linear) == (other.op, other.axis, other.linear)
        # the MLP's weight blocks (z) and its f-wide activations (x: the up-projection's
        # output, the down-projection's dX) halve; its h-wide ones (y) do not
        halves = mine.linear in ("fc1", "fc2") and mine.axis in ("z", "x")
        assert mine.elements == other.elements * (0.5 if halves else 1.0), (mine, other)
    assert any(c.linear == "fc1" and c.axis == "x" for c in ours)


def test_the_step_time_uses_the_toy(toy):
    gpt = ModelSpec("gpt", **SHAPE)
    ours, theirs = (step_time(hardware=HW, model=m, train=TRAIN, grid=GRID) for m in (toy, gpt))
    flops = toy.flops_per_token(TRAIN.seq_len, recompute=False) / gpt.flops_per_token(
        TRAIN.seq_len, recompute=False
    )
    assert math.isclose(ours.model_flops_per_gpu / theirs.model_flops_per_gpu, flops)
    assert ours.compute < theirs.compute
    assert ours.comm_raw["x"] < theirs.comm_raw["x"]
    assert ours.comm_raw["z"] < theirs.comm_raw["z"]


def test_the_job_builds_and_runs_the_toy(toy):
    gpt_spec = ModelSpec("gpt", **SHAPE)
    groups = single_process_groups()
    model = build_model(toy, groups=groups, overlap=OverlapConfig(), seed=1)
    gpt = build_model(gpt_spec, groups=groups, overlap=OverlapConfig(), seed=1)
    assert type(model) is HalfMLPGPT and type(gpt) is GPT
    assert sum(p.numel() for p in model.parameters()) == toy.n_params()
    assert sum(p.numel() for p in gpt.parameters()) == gpt_spec.n_params() != toy.n_params()
    assert model.blocks[0].mlp.up.weight.numel() == 128 * 64
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(idx, idx)
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(256)) < 1.0
    assert model.all_logits(idx).shape == (2, 32, 256)
