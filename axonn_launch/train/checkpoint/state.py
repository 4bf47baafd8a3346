"""The training state of one rank as a DCP state dict, and back; ``save`` and ``resume``
are the training job's.

Parameters and AdamW's moments are saved under their full names and shapes, so any
DCP reader sees ordinary tensors, and a checkpoint resumes on another grid.

The keys and how another grid reads them: ``docs/checkpoints.md``
("train/checkpoint/state.py").
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from axonn_launch.common.formats import LEGACY_FORMAT
from axonn_launch.common.grid import Grid
from axonn_launch.common.spec import JobSpec
from axonn_launch.train.checkpoint.manager import (
    Checkpointer,
    load_state,
    read_meta,
    rng_state,
    set_rng_state,
)
from axonn_launch.train.models.adamw import MOMENTS, AdamW
from axonn_launch.train.parallel.bootstrap import DistEnv
from axonn_launch.train.parallel.groups import Groups
from axonn_launch.train.parallel.shards import ShardSpec, shard_spec


class Stateful(Protocol):
    """What a checkpoint saves and restores of the data loader: its position."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def moment_key(name: str, moment: str) -> str:
    return f"optimizer.state.{name}.{moment}"


def step_key(name: str) -> str:
    """AdamW's step count of parameter ``name``: the same on every rank."""
    return f"optimizer.state.{name}.step"


def rank_key(rank: int) -> str:
    return f"rank_state.{rank}"


def shard_specs(model: nn.Module, groups: Groups, *, banded: bool) -> dict[str, ShardSpec]:
    """The spec of every parameter and of both its moments (banded for saving)."""
    specs = {}
    for name, param in model.named_parameters():
        spec = shard_spec(param.shard_layout, groups, param.element_size(), banded=banded)
        specs[name] = spec
        for moment in MOMENTS:
            specs[moment_key(name, moment)] = spec
    return specs


def ensure_optimizer_state(model: nn.Module, optimizer: AdamW) -> None:
    """Zero moments for parameters that have none yet (before the first step)."""
    for param in model.parameters():
        optimizer.moments(param)


def _tensors(model: nn.Module, optimizer: AdamW) -> dict[str, torch.Tensor]:
    ensure_optimizer_state(model, optimizer)
    out = {}
    for name, param in model.named_parameters():
        entry = optimizer.state[param]
        out[name] = param.detach()
        for moment in MOMENTS:
            out[moment_key(name, moment)] = entry[moment]
        out[step_key(name)] = entry["step"]
    return out


def _pack(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def save_training_state(
    checkpointer: Checkpointer,
    step: int,
    *,
    model: nn.Module,
    optimizer: AdamW,
    loader_state: dict,
    rng: dict,
    groups: Groups,
    meta: dict,
) -> None:
    """Start the asynchronous save of this rank's state as step ``step`` (collective)."""
    state: dict[str, object] = dict(_tensors(model, optimizer))
    state[rank_key(groups.rank)] = _pack({"loader": loader_state, "rng": rng})
    state["meta"] = json.dumps({**meta, "step": step})
    same = ["meta", *(step_key(name) for name, _ in model.named_parameters())]  # every rank's
    checkpointer.save(step, state, shard_specs(model, groups, banded=True), meta, same)


def load_training_state(
    path: Path,
    *,
    model: nn.Module,
    optimizer: AdamW,
    groups: Groups,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict, dict, dict, int]:
    """Load ``path`` into this rank's model and optimizer, whatever grid wrote it.

    Returns (loader state, rng state, meta, bytes read by this rank).
    """
    meta = read_meta(path)
    old_world = Grid(**meta["grid"]).world_size
    source = groups.rank if groups.rank < old_world else 0
    model.runtime.drop_prefetched()
    state: dict[str, object] = dict(_tensors(model, optimizer))
    state[rank_key(source)] = b""
    with torch.no_grad():
        bytes_read = load_state(path, state, shard_specs(model, groups, banded=False), group=group)
    small = _unpack(state[rank_key(source)])
    return small["loader"], small["rng"], meta, bytes_read


def load_model_weights(
    path: Path, *, model: nn.Module, groups: Groups, group: dist.ProcessGroup | None = None
) -> int:
    """Load only the parameters of ``path`` into this rank's model (generation,
    evaluation), whatever grid wrote it; returns the bytes this rank read."""
    model.runtime.drop_prefetched()
    state = {name: param.data for name, param in model.named_parameters()}
    specs = {
        name: shard_spec(param.shard_layout, groups, param.element_size(), banded=False)
        for name, param in model.named_parameters()
    }
    with torch.no_grad():
        return load_state(path, state, specs, group=group)


# --------------------------------------------------------------------------- the job's


def resume(
    checkpoint: Path,
    spec: JobSpec,
    env: DistEnv,
    model: nn.Module,
    optimizer: AdamW,
    loader: Stateful,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Load this rank's state from ``checkpoint``; returns the optimizer steps it had done.

    Any grid's checkpoint loads: each rank reads only the saved chunks overlapping its
    shard (``load_training_state``). A checkpoint of the previous format
    (per-rank files) goes through ``axonn_launch.train.checkpoint.legacy``.
    """
    device = torch.device(env.device)
    meta = read_meta(checkpoint)
    if meta.get("format") == LEGACY_FORMAT:
        from axonn_launch.train.checkpoint.legacy import load_legacy

        loader_state, rng = load_legacy(
            checkpoint, meta, model=model, optimizer=optimizer, groups=model.groups, device=device
        )
    else:
        loader_state, rng, meta, _ = load_training_state(
            checkpoint, model=model, optimizer=optimizer, groups=model.groups, group=group
        )
    loader.load_state_dict(loader_state)
    set_rng_state(rng, device)
    return int(meta["step"])


def save(
    spec: JobSpec,
    env: DistEnv,
    step: int,
    model: nn.Module,
    optimizer: AdamW,
    loader: Stateful,
    checkpointer: Checkpointer,
) -> None:
    """Start an asynchronous checkpoint of step ``step`` (collective)."""
    meta = {"grid": spec.grid.as_dict(), "world_size": env.world_size, "model": asdict(spec.model)}
    save_training_state(
        checkpointer,
        step,
        model=model,
        optimizer=optimizer,
        loader_state=loader.state_dict(),
        rng=rng_state(torch.device(env.device)),
        groups=model.groups,
        meta=meta,
    )
