"""The parallel GPT on every 4-rank grid (and several 8-rank grids) equals one process.

For each grid, with the overlaps off and on (and once with activation checkpointing):
the initial full weights equal those of the single-process model with the same seed;
after loading a perturbed full state (non-zero biases and norms), the loss, the
last-position logits and every gathered parameter gradient equal those of an
independent plain-PyTorch GPT; and over 5 AdamW steps with clipping (two micro-steps
per step) the losses and gradient norms agree to 1e-5 relative (5 steps: the optimizer
state after the first step already depends on every earlier gradient; 10 cost the suite
twice the time for no new path).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.cost.planner import enumerate_grids
from axonn_launch.train.models.adamw import AdamW
from axonn_launch.train.models.gpt import (
    GPT,
    clip_grad_norm_,
    count_unique_params,
    finish_gradients,
    full_grad_dict,
    full_state_dict,
    load_full_state_dict,
)
from axonn_launch.train.parallel.groups import build_groups, single_process_groups
from tests.train.dist_utils import run_world
from tests.train.reference import ReferenceGPT

SPEC = ModelSpec("tiny", n_layer=2, d_model=32, n_head=4, vocab_size=64, max_seq_len=16)
SPEC_ODD_VOCAB = ModelSpec("tiny61", n_layer=2, d_model=32, n_head=4, vocab_size=61, max_seq_len=16)
MICRO_BATCH = 8  # sequences per micro-step, whole job
SEQ = 16
ACCUMULATION = 2
STEPS = 5
LR, WEIGHT_DECAY, MAX_NORM = 1e-2, 0.1, 0.5
SEED = 7

OFF = OverlapConfig(all_reduce=False, reduce_scatter=False, all_gather=False)
ON = OverlapConfig()


GRIDS_8 = [
    Grid(x=2, y=2, z=2),
    Grid(data=2, x=2, y=2),
    Grid(data=2, x=2, z=2),
    Grid(data=2, y=2, z=2),
    Grid(x=2, y=4),
]


def test_single_process_parameter_count_matches_spec():
    for spec in (SPEC, SPEC_ODD_VOCAB):
        groups = single_process_groups()
        model = GPT(spec, groups=groups, overlap=OFF)
        assert count_unique_params(model, groups) == spec.n_params()
        assert sum(t.numel() for t in full_state_dict(model, groups).values()) == spec.n_params()


def _batches(step: int, micro: int, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, spec.vocab_size, (MICRO_BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _local(t: torch.Tensor, grid: Grid, rank: int) -> torch.Tensor:
    """This rank's sequences: the batch is split over data (outer) and z (inner)."""
    c = grid.coords(rank)
    return t.chunk(grid.data * grid.z)[c.data * grid.z + c.z]


def _global_mean(value: torch.Tensor, model: GPT) -> float:
    value = value.detach().clone()
    model.comm.all_reduce(value, "z")
    model.comm.all_reduce(value, "data")
    return float(value) / (model.groups.grid.z * model.groups.grid.data)


def _perturbed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in sorted(state.items())}


@functools.cache  # in each rank, once per spec
def _reference(spec: ModelSpec) -> dict:
    """What the independent plain-PyTorch GPT computes from the perturbed seed-SEED state:
    the same for every grid, overlap and checkpointing of ``spec``, so each rank computes
    it once per spec (not once per case): the last-position logits of batch 0, the full
    gradients of step 0, and each step's loss and clipped gradient norm."""
    serial = GPT(spec, groups=single_process_groups(), overlap=OFF, seed=SEED)
    initial = full_state_dict(serial, single_process_groups())
    state = _perturbed(initial)
    reference = ReferenceGPT(spec, state)
    idx, _ = _batches(0, 0, spec)
    with torch.no_grad():
        logits = reference.logits(idx)[:, -1]
    ref_opt = AdamW([{"params": reference.parameters()}], lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        ref_loss = 0.0
        for micro in range(ACCUMULATION):
            idx, targets = _batches(step + 1, micro, spec)
            full_loss = reference(idx, targets)
            (full_loss / ACCUMULATION).backward()
            ref_loss += float(full_loss.detach()) / ACCUMULATION
        if step == 0:
            grads = {n: p.grad.clone() for n, p in reference.named_full().items()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        losses.append(ref_loss)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    return {"initial": initial, "state": state, "logits": logits, "grads": grads,
            "losses": losses, "norms": norms}  # fmt: skip


def _check_grid(rank, grid, spec, overlap, checkpointing) -> None:
    label = f"[{grid.describe()} overlap={overlap} ckpt={checkpointing} V={spec.vocab_size}]"
    ref = _reference(spec)
    groups = build_groups(grid, rank=rank)
    model = GPT(spec, groups=groups, overlap=overlap, activation_checkpointing=checkpointing,
                seed=SEED)  # fmt: skip
    initial = full_state_dict(model, groups)
    for name, tensor in ref["initial"].items():
        assert torch.equal(initial[name], tensor), f"{label} init of {name} depends on the grid"
    assert count_unique_params(model, groups) == spec.n_params(), label

    state = ref["state"]
    load_full_state_dict(model, groups, state)
    for name, tensor in full_state_dict(model, groups).items():
        assert torch.equal(tensor, state[name]), f"{label} load/gather round trip of {name}"

    idx, _ = _batches(0, 0, spec)
    with torch.no_grad():
        logits = model(_local(idx, grid, rank))
        expected = _local(ref["logits"], grid, rank)
    torch.testing.assert_close(logits, expected, msg=lambda m: f"{label} logits: {m}")

    opt = AdamW([{"params": model.parameters()}], lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(STEPS):
        loss = 0.0
        for micro in range(ACCUMULATION):
            idx, targets = _batches(step + 1, micro, spec)
            local_loss = model(_local(idx, grid, rank), _local(targets, grid, rank))
            (local_loss / ACCUMULATION).backward()
            loss += _global_mean(local_loss, model) / ACCUMULATION
        finish_gradients(model, groups)
        if step == 0:
            _assert_grads_equal(model, groups, ref["grads"], label)
        norm = clip_grad_norm_(model, MAX_NORM, groups)
        assert loss == pytest.approx(ref["losses"][step], rel=1e-5), f"{label} step {step} loss"
        assert norm == pytest.approx(ref["norms"][step], rel=1e-5), f"{label} step {step} norm"
        opt.step()
        opt.zero_grad(set_to_none=True)


def _assert_grads_equal(model, groups, expected, label) -> None:
    grads = full_grad_dict(model, groups)
    for name, grad in expected.items():
        torch.testing.assert_close(
            grads[name], grad, msg=lambda m, n=name: f"{label} grad of {n}: {m}"
        )


def _check_grids(rank: int, world: int, cases: list) -> int:
    for grid, spec, overlap, checkpointing in cases:
        _check_grid(rank, grid, spec, overlap, checkpointing)
        dist.barrier()
    return len(cases)


def _cases(grids: list[Grid]) -> list:
    cases = []
    for i, grid in enumerate(grids):
        spec = SPEC_ODD_VOCAB if i % 2 else SPEC
        cases.append((grid, spec, OFF, False))
        cases.append((grid, spec, ON, i % 3 == 0))
    return cases


def test_every_four_rank_grid_equals_single_process():
    """Over 60 s on 2 cores: every 4-rank grid, each checked against one process."""
    cases = _cases(enumerate_grids(4))
    assert run_world(_check_grids, 4, cases, timeout=900) == [len(cases)] * 4


@pytest.mark.slow
def test_eight_rank_grids_equal_single_process():
    """Over 60 s on 2 cores: 8 ranks on 2 cores, each grid checked against one process."""
    cases = _cases(GRIDS_8)
    assert run_world(_check_grids, 8, cases, timeout=900) == [len(cases)] * 8
