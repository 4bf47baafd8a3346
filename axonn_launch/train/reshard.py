"""Resume from a checkpoint written on another grid (e.g. x=2,z=2 on 4 ranks -> data=2).

Each rank of the new grid reads every rank file of the old checkpoint and rebuilds the
full (unsharded) parameters and AdamW moments: a shard's elements sit at the positions
``ShardLayout.full_indices`` gives for that old rank, which needs only the old grid and
the rank's coordinates, not the old process groups. The full tensors are then sliced
for this rank with ``ShardLayout.local_from_full`` (as ``load_full_state_dict`` does).
The layouts are the model's own; the one grid-dependent field, the vocab padding
``pad_rows_to`` (a multiple of the x*y plane size), is recomputed for the old grid.

The loader position is the number of optimizer steps done, the same on every grid;
RNG states come from the old rank with the same index (rank 0 for new ranks beyond the
old world). Memory: one full copy of the model and of both moments per rank, and one
old rank file at a time (memory-mapped).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn

from axonn_launch.grid import Grid
from axonn_launch.train.groups import Groups
from axonn_launch.train.layers import ShardLayout

MOMENTS = ("exp_avg", "exp_avg_sq")


def grid_position(grid: Grid, rank: int) -> Groups:
    """Coordinates of ``rank`` in ``grid`` as a ``Groups`` without process groups."""
    none = dict.fromkeys(("x", "y", "z", "data", "plane"))
    return Groups(grid=grid, rank=rank, coords=grid.coords(rank), **none)


def layout_on(layout: ShardLayout, grid: Grid) -> ShardLayout:
    """``layout`` as it was on ``grid`` (the vocab padding depends on the plane size)."""
    if layout.pad_rows_to is None:
        return layout
    plane = grid.x * grid.y
    return dataclasses.replace(layout, pad_rows_to=-(-layout.full_shape[0] // plane) * plane)


def optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter name of each optimizer state index (the order of ``param_groups``)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather_full(
    path: Path, old_grid: Grid, model: nn.Module, names: list[str]
) -> tuple[dict[str, torch.Tensor], dict[tuple[str, str], torch.Tensor], dict, list[dict]]:
    """Full parameters, full moments, per-index optimizer steps, and the old rank states.

    The last item holds each old rank's small entries (loader, rng), not its tensors.
    """
    params = dict(model.named_parameters())
    old = {n: layout_on(p.shard_layout, old_grid) for n, p in params.items()}
    full = {n: torch.zeros(math.prod(p.shard_layout.full_shape)) for n, p in params.items()}
    moments: dict[tuple[str, str], torch.Tensor] = {}
    steps: dict[int, torch.Tensor] = {}
    small = []
    for rank in range(old_grid.world_size):
        state = torch.load(
            path / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False, mmap=True
        )
        position = grid_position(old_grid, rank)
        for name in params:
            _scatter(full[name], old[name], position, state["model"][name])
        for index, entry in state["optimizer"]["state"].items():
            name = names[index]
            steps.setdefault(index, entry["step"])
            for key in MOMENTS:
                target = moments.setdefault((name, key), torch.zeros_like(full[name]))
                _scatter(target, old[name], position, entry[key])
        small.append({"loader": state["loader"], "rng": state["rng"]})
    return full, moments, steps, small


def _scatter(full: torch.Tensor, layout: ShardLayout, position: Groups, local: torch.Tensor):
    index = layout.full_indices(position)
    keep = index >= 0
    full[index[keep]] = local.detach().reshape(-1).float().cpu()[keep]


def load_resharded(
    path: Path,
    meta: dict,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader,
    groups: Groups,
    device: torch.device,
) -> tuple[dict, dict]:
    """Load the checkpoint at ``path`` (written on ``meta["grid"]``) onto this rank.

    Returns (loader state, rng state) for the caller to apply, as for a same-grid load.
    """
    from axonn_launch.train.model import load_full_state_dict

    old_grid = Grid(**meta["grid"])
    names = optimizer_names(model, optimizer)
    full, moments, steps, small = gather_full(path, old_grid, model, names)
    params = dict(model.named_parameters())
    shaped = {n: full[n].view(params[n].shard_layout.full_shape) for n in params}
    load_full_state_dict(model, groups, shaped)
    state = optimizer.state_dict()
    state["state"] = {}
    for index, name in enumerate(names):
        if (name, MOMENTS[0]) not in moments:
            continue  # no step taken for this parameter yet
        layout = params[name].shard_layout
        entry = {"step": steps[index].clone()}
        for key in MOMENTS:
            full_moment = moments[(name, key)].view(layout.full_shape)
            entry[key] = layout.local_from_full(full_moment, groups).to(device)
        state["state"][index] = entry
    optimizer.load_state_dict(state)
    mine = small[groups.rank] if groups.rank < len(small) else small[0]
    return mine["loader"], mine["rng"]
