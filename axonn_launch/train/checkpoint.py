"""Atomic per-rank checkpoints under ``<job_dir>/checkpoints``.

Layout::

    checkpoints/
      step_00000120/
        meta.json          step, grid, model shape, format (written by rank 0)
        rank_00000.pt ...  this rank's model shards, optimizer state, RNG states, loader
      latest               text file naming the newest complete step directory

Every rank writes into ``.tmp_step_<n>``; after a barrier rank 0 writes ``meta.json``,
renames the directory to ``step_<n>`` and only then replaces ``latest`` (write a temp
file, ``os.replace``). A crash at any point leaves ``latest`` naming a complete
checkpoint. Assumes ``job_dir`` is on a file system all ranks share.

The shards are tied to the grid they were written on; ``meta.json`` records that grid
so a loader for another grid can gather each rank file's shards into full tensors and
re-shard them with ``load_full_state_dict``. Loading on a different grid is refused
for now.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from axonn_launch.grid import Grid

FORMAT = "per-rank-shards/1"


def checkpoint_root(job_dir: Path | str) -> Path:
    return Path(job_dir) / "checkpoints"


def latest_checkpoint(job_dir: Path | str) -> Path | None:
    pointer = checkpoint_root(job_dir) / "latest"
    if not pointer.exists():
        return None
    path = checkpoint_root(job_dir) / pointer.read_text().strip()
    if not (path / "meta.json").exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is incomplete or missing")
    return path


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(
    job_dir: Path | str, *, step: int, rank: int, state: dict, meta: dict, keep: int
) -> Path:
    """Collective: every rank saves ``state``; returns the checkpoint directory."""
    root = checkpoint_root(job_dir)
    name = f"step_{step:08d}"
    tmp, final = root / f".tmp_{name}", root / name
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    _atomic_torch_save(state, tmp / f"rank_{rank:05d}.pt")
    _barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "format": FORMAT}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _atomic_write_text(root / "latest", name)
        _prune(root, keep)
    _barrier()
    return final


def load_checkpoint(
    path: Path, *, rank: int, grid: Grid, map_location: torch.device
) -> tuple[dict, dict]:
    """(this rank's state, meta) of the checkpoint at ``path``, written on this same grid.

    A checkpoint of another grid goes through ``axonn_launch.train.reshard`` instead
    (``axonn_launch.train.resume`` picks the path).
    """
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r}")
    saved = Grid(**meta["grid"])
    if saved != grid:
        raise ValueError(
            f"{path} was written on grid {saved.describe()}, this job runs on "
            f"{grid.describe()}; load it with axonn_launch.train.reshard"
        )
    state = torch.load(path / f"rank_{rank:05d}.pt", map_location=map_location, weights_only=False)
    return state, meta


def _atomic_torch_save(obj: dict, path: Path) -> None:
    part = path.with_name(path.name + ".part")
    torch.save(obj, part)
    os.replace(part, path)


def _atomic_write_text(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (``keep <= 0``: keep all)."""
    if keep <= 0:
        return
    complete = sorted(p for p in root.glob("step_*") if (p / "meta.json").exists())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
