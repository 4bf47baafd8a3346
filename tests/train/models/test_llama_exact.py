"""Our Llama on 1 rank, every 4-rank grid and two 8-rank grids equals Hugging Face's.

A tiny random ``LlamaForCausalLM`` (2 layers, hidden 64, 4 heads, 2 KV heads, vocab
512, Llama 3 rope scaling, untied head) is built locally; its weights are loaded into
our model through ``axonn_launch.common.hf.hf_segments`` (the same row ranges the importer and
the exporter use). On every grid: the logits of every position equal HF's (fp32, rel
1e-4), and so do the loss and every gathered parameter gradient. Grids with y=4 hold
the 2 KV heads twice over y (``y_replicas``), whose gradients are summed by
``finish_gradients``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from axonn_launch.common.grid import Grid
from axonn_launch.common.hf import hf_segments, spec_from_hf_config
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.cost.planner import enumerate_grids
from axonn_launch.train.models.gpt import finish_gradients, full_grad_dict, load_full_state_dict
from axonn_launch.train.models.registry import build_model
from axonn_launch.train.parallel.groups import build_groups
from tests.train.dist_utils import run_world

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 4, 24
GRIDS_8 = [Grid(x=2, y=4), Grid(data=2, y=2, z=2)]


def tiny_hf_config(**overrides) -> transformers.LlamaConfig:
    settings = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
        rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )  # fmt: skip
    settings.update(overrides)
    return transformers.LlamaConfig(**settings)


def ours_from_hf(spec, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        ours: torch.cat([hf_state[name] for name, _ in segments])
        for ours, segments in hf_segments(spec).items()
    }


@pytest.fixture(scope="module")
def case():
    """(spec, our full state, inputs, targets, HF logits, HF loss, HF grads as ours)."""
    torch.manual_seed(0)
    config = tiny_hf_config()
    hf = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():  # random norms, so that a wrong norm weight layout shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    spec = spec_from_hf_config(config.to_dict(), "tiny-llama")
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = hf(inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    grads = ours_from_hf(spec, {n: p.grad for n, p in hf.named_parameters()})
    state = ours_from_hf(spec, {n: p.detach() for n, p in hf.named_parameters()})
    return spec, state, inputs, targets, logits.detach(), loss.item(), grads


def _rank_results(rank, world_size, grids, spec, state, inputs, targets, overlap):
    """This rank's (logits, loss, gathered gradients) on each grid of one world."""
    return [_one_grid(rank, grid, spec, state, inputs, targets, overlap) for grid in grids]


def _one_grid(rank, grid, spec, state, inputs, targets, overlap):
    groups = build_groups(grid, rank=rank)
    model = build_model(spec, groups=groups, overlap=overlap)
    load_full_state_dict(model, groups, state)
    logits = model.all_logits(inputs)
    rows = BATCH // (grid.data * grid.z)
    first = (groups.coords.data * grid.z + groups.coords.z) * rows
    loss = model(inputs[first : first + rows], targets[first : first + rows])
    loss.backward()
    finish_gradients(model, groups)
    grads = {name: g.numpy() for name, g in full_grad_dict(model, groups).items()}
    return logits.numpy(), float(loss.detach()), grads  # numpy: pickled by value


def _check(results, case, grid):
    spec, state, inputs, targets, hf_logits, hf_loss, hf_grads = case
    for logits, _, grads in results:
        torch.testing.assert_close(
            torch.from_numpy(logits), hf_logits, rtol=1e-4, atol=1e-5,
            msg=lambda m: f"{grid.describe()} logits: {m}",
        )  # fmt: skip
        for name, expected in hf_grads.items():
            torch.testing.assert_close(
                torch.from_numpy(grads[name]), expected, rtol=1e-4, atol=1e-6,
                msg=lambda m, n=name: f"{grid.describe()} {n}: {m}",
            )  # fmt: skip
    mean_loss = sum(loss for _, loss, _ in results) / len(results)
    assert mean_loss == pytest.approx(hf_loss, rel=1e-5), grid.describe()


def _run(case, grids: list[Grid]) -> None:
    """Every grid of one world size in one spawned world (the groups of each grid are
    built in turn), each checked against HF."""
    spec, state, inputs, targets, *_ = case
    per_rank = run_world(
        _rank_results, grids[0].world_size, grids, spec, state, inputs, targets,
        OverlapConfig(),
    )  # fmt: skip
    for i, grid in enumerate(grids):
        _check([results[i] for results in per_rank], case, grid)


def test_one_rank_equals_hf(case):
    _run(case, [Grid()])


@pytest.mark.slow
def test_every_4_rank_grid_equals_hf(case):
    _run(case, enumerate_grids(4))


@pytest.mark.slow
def test_two_8_rank_grids_equal_hf(case):
    _run(case, GRIDS_8)
