"""Checkpoints of the previous format (per-rank-shards/1) still resume, on any grid.

The fixtures are written with that format's layout (``legacy_rank_state``: qkv rows by
head, vocab padding of the old plane), as its ``save`` did, from known full tensors.
"""

from __future__ import annotations

import pytest
import torch

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig, TrainConfig
from axonn_launch.train.checkpoint.legacy import (
    MOMENTS,
    legacy_rank_state,
    load_legacy,
    write_legacy,
)
from axonn_launch.train.models.gpt import GPT
from axonn_launch.train.models.optim import build_optimizer
from axonn_launch.train.parallel.shards import grid_position

SPEC = ModelSpec(name="t", n_layer=2, d_model=64, n_head=4, vocab_size=65, max_seq_len=32)
OLD_GRID = Grid(x=2, y=2)


def sharded_model(grid: Grid, rank: int):
    groups = grid_position(grid, rank)
    model = GPT(SPEC, groups=groups, overlap=OverlapConfig(), seed=7)
    return model, build_optimizer(model, TrainConfig()), groups


def full_tensors(model) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        key: torch.randn(p.shard_layout.full_shape, generator=generator)
        for n, p in model.named_parameters()
        for key in (n, *(f"{n}.{m}" for m in MOMENTS))
    }


def write_fixture(path, grid: Grid) -> dict[str, torch.Tensor]:
    full = None
    states = []
    for rank in range(grid.world_size):
        model, optimizer, groups = sharded_model(grid, rank)
        full = full or full_tensors(model)
        small = {"loader": {"step": 5, "rank": rank}, "rng": {"rank": rank}}
        states.append(legacy_rank_state(model, optimizer, groups, full, step=5, small=small))
    write_legacy(path, {"grid": grid.as_dict(), "model": SPEC.__dict__, "step": 5}, states)
    return full


@pytest.mark.parametrize(
    "new_grid, new_rank", [({"x": 2, "y": 2}, 1), ({"data": 2}, 1), ({"y": 2}, 1), ({"x": 4}, 3)]
)
def test_legacy_checkpoint_loads_on_any_grid(tmp_path, new_grid, new_rank):
    full = write_fixture(tmp_path, OLD_GRID)
    model, optimizer, groups = sharded_model(Grid(**new_grid), new_rank)
    loader, rng = load_legacy(
        tmp_path,
        {"grid": OLD_GRID.as_dict()},
        model=model,
        optimizer=optimizer,
        groups=groups,
        device=torch.device("cpu"),
    )
    assert loader == {"step": 5, "rank": new_rank} and rng == {"rank": new_rank}
    for name, param in model.named_parameters():
        layout = param.shard_layout
        assert torch.equal(param.detach(), layout.local_from_full(full[name], groups)), name
        entry = optimizer.state[param]
        assert float(entry["step"]) == 5.0
        for m in MOMENTS:
            assert torch.equal(entry[m], layout.local_from_full(full[f"{name}.{m}"], groups))
