"""Checkpoints of the previous format, ``per-rank-shards/1``: resume and convert.

Kept so that no run is lost: a job resumes from such a checkpoint on any grid, and
``python -m axonn_launch.export --convert-legacy`` turns it into the current format once.
``write_legacy`` writes the old layout (for tests and for converting fixtures).

The old format and why it was replaced: ``docs/checkpoints.md``
("train/checkpoint/legacy.py").
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from torch import nn

from axonn_launch.common.formats import LEGACY_FORMAT
from axonn_launch.common.grid import Grid
from axonn_launch.common.jobdir import STEP_META
from axonn_launch.train.models.adamw import MOMENTS, AdamW
from axonn_launch.train.parallel.groups import Groups
from axonn_launch.train.parallel.layers import ShardLayout
from axonn_launch.train.parallel.shards import grid_position


def qkv_row_order(n_head: int, head_dim: int) -> torch.Tensor:
    """The qkv row order of this format: (head, q/k/v, dim), the same on every grid."""
    return torch.arange(3 * n_head * head_dim).view(3, n_head, head_dim).transpose(0, 1).reshape(-1)


def layout_on(layout: ShardLayout, grid: Grid, n_head: int) -> ShardLayout:
    """``layout`` as this format had it on ``grid``: the vocab padding depends on the
    plane size, and qkv rows were ordered by head."""
    if layout.row_order is not None:
        rows = layout.full_shape[0]
        layout = dataclasses.replace(layout, row_order=qkv_row_order(n_head, rows // 3 // n_head))
    if layout.pad_rows_to is None:
        return layout
    plane = grid.x * grid.y
    return dataclasses.replace(layout, pad_rows_to=-(-layout.full_shape[0] // plane) * plane)


def optimizer_names(model: nn.Module, optimizer: AdamW) -> list[str]:
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
    old = {n: layout_on(p.shard_layout, old_grid, model.spec.n_head) for n, p in params.items()}
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


def load_legacy(
    path: Path,
    meta: dict,
    *,
    model: nn.Module,
    optimizer: AdamW,
    groups: Groups,
    device: torch.device,
) -> tuple[dict, dict]:
    """Load the checkpoint at ``path`` (written on ``meta["grid"]``) onto this rank.

    Returns (loader state, rng state) for the caller to apply, as for a same-grid load.
    """
    from axonn_launch.train.models.gpt import load_full_state_dict

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


def write_legacy(path: Path, meta: dict, rank_states: list[dict]) -> None:
    """Write a complete ``per-rank-shards/1`` checkpoint directory (one state per rank)."""
    path.mkdir(parents=True, exist_ok=True)
    for rank, state in enumerate(rank_states):
        torch.save(state, path / f"rank_{rank:05d}.pt")
    (path / STEP_META).write_text(json.dumps({**meta, "format": LEGACY_FORMAT}))


def legacy_rank_state(
    model: nn.Module,
    optimizer: AdamW,
    groups: Groups,
    full: dict[str, torch.Tensor],
    *,
    step: float,
    small: dict,
) -> dict:
    """What this format's ``save`` wrote for the rank of ``groups``: ``model`` and
    ``optimizer`` (built on that rank's grid) hold ``full[name]`` and the moments
    ``full[f"{name}.exp_avg"]`` / ``full[f"{name}.exp_avg_sq"]`` cut in this format's
    layout; ``small`` holds the loader and rng entries."""
    n_head = model.spec.n_head
    model_state, by_param = {}, {}
    for name, param in model.named_parameters():
        layout = layout_on(param.shard_layout, groups.grid, n_head)
        model_state[name] = layout.local_from_full(full[name], groups)
        by_param[id(param)] = {
            "step": torch.tensor(float(step)),
            **{m: layout.local_from_full(full[f"{name}.{m}"], groups) for m in MOMENTS},
        }
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer_state = optimizer.state_dict()
    optimizer_state["state"] = {i: by_param[id(p)] for i, p in enumerate(params)}
    return {"model": model_state, "optimizer": optimizer_state, **small}
