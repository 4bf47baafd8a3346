"""Weight caching (``cache_layers``) changes no number, only when weights are gathered.

On grids with z > 1 (the only ones that gather), each with the four settings of wire,
overlap and activation checkpointing that hold every pair of their values (a pairwise
design: half the full factorial's runs, and any fault that needs two of them together is
still met): the gradients of two micro-steps with the first
0, 1 or 2 blocks cached are bit-identical, with the fp32 and with a bf16 wire (the
cache holds the block as it was gathered). The cache holds exactly the first N
blocks' four gathered weight blocks, in the wire dtype, from the forward until the
backward, and is empty afterwards; a forward that is not followed by a backward leaves
nothing behind for the next micro-step (its blocks would be stale: the weights change
before it). The collectives themselves are counted in
test_comm_volume.py.
"""

from __future__ import annotations

import torch

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.train.models.gpt import GPT, finish_gradients, full_grad_dict
from axonn_launch.train.parallel.comm import FP32_WIRE, Wire
from axonn_launch.train.parallel.groups import build_groups
from tests.train.dist_utils import run_world

SPEC = ModelSpec("tiny", n_layer=2, d_model=32, n_head=4, vocab_size=61, max_seq_len=16)
MICRO_BATCH, SEQ = 8, 16
GRIDS = [Grid(z=4), Grid(x=2, z=2), Grid(y=2, z=2)]
OVERLAPS = [OverlapConfig(False, False, False), OverlapConfig()]
BF16_WIRE = Wire(torch.bfloat16, torch.bfloat16, torch.bfloat16)
SETTINGS = [  # (wire, overlap, activation checkpointing): every pair of values once
    (FP32_WIRE, OVERLAPS[0], False),
    (FP32_WIRE, OVERLAPS[1], True),
    (BF16_WIRE, OVERLAPS[0], True),
    (BF16_WIRE, OVERLAPS[1], False),
]


def _tokens(grid: Grid, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(20 + micro)
    return torch.randint(0, SPEC.vocab_size, (MICRO_BATCH // grid.z, SEQ), generator=gen)


def _block_bytes(model: GPT, blocks: int, wire: Wire) -> int:
    """What the first ``blocks`` blocks' gathered weights take in the wire dtype."""
    linears = [layer for block in model.blocks[:blocks] for layer in block.linears()]
    itemsize = wire.all_gather.itemsize
    return sum(layer.block_shape[0] * layer.block_shape[1] * itemsize for layer in linears)


def _gradients(groups, grid, overlap, checkpointing, wire, cache_layers, label):
    model = GPT(SPEC, groups=groups, overlap=overlap, activation_checkpointing=checkpointing,
                wire=wire, cache_layers=cache_layers, seed=5)  # fmt: skip
    held = _block_bytes(model, cache_layers, wire)
    with torch.no_grad():
        model(_tokens(grid, 0))  # inference: nothing cached
    assert model.runtime.cached_bytes == 0, label
    model(_tokens(grid, 0), _tokens(grid, 0))  # a training forward with no backward
    assert model.runtime.cached_bytes == held, label
    with torch.no_grad():  # the weights change: what that forward cached is stale
        for param in model.parameters():
            param.mul_(0.5)
    for micro in range(2):
        loss = model(_tokens(grid, micro), _tokens(grid, micro))
        assert model.runtime.cached_bytes == held, f"{label} after forward {micro}"
        loss.backward()
        assert model.runtime.cached_bytes == 0, f"{label} after backward {micro}"
    finish_gradients(model, groups)
    return full_grad_dict(model, groups)


def _check(rank: int, world: int) -> int:
    checked = 0
    for grid in GRIDS:
        groups = build_groups(grid, rank=rank)
        for wire, overlap, checkpointing in SETTINGS:
            label = f"[{grid.describe()} {wire.all_gather} {overlap} ckpt={checkpointing}]"
            args = (groups, grid, overlap, checkpointing, wire)
            plain = _gradients(*args, 0, label)
            for cache_layers in (1, 2):
                cached = _gradients(*args, cache_layers, f"{label} cache={cache_layers}")
                for name, grad in plain.items():
                    assert torch.equal(cached[name], grad), f"{label} {name}"
                checked += 1
    return checked


def test_cached_weights_give_identical_gradients_and_are_freed():
    """About 45 s on 2 cores under load: one 4-rank world checks every grid in each of the
    pairwise settings, cached against uncached weights (a world per case would cost more)."""
    expected = len(GRIDS) * len(SETTINGS) * 2
    assert run_world(_check, 4, timeout=600) == [expected] * 4
