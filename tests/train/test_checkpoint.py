"""Atomic checkpoints: the latest pointer, pruning, interrupted saves, grid checks."""

from __future__ import annotations

import json

import pytest
import torch

from axonn_launch.grid import Grid
from axonn_launch.train.checkpoint import (
    checkpoint_root,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

CPU = torch.device("cpu")


def save(job_dir, step, keep=2, grid=None):
    grid = grid or Grid()
    state = {"model": {"w": torch.full((3,), float(step))}, "step": step}
    return save_checkpoint(
        job_dir, step=step, rank=0, state=state, meta={"grid": grid.as_dict()}, keep=keep
    )


def test_no_checkpoint_means_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None


def test_save_then_load_round_trip(tmp_path):
    path = save(tmp_path, 7)
    assert latest_checkpoint(tmp_path) == path
    state, meta = load_checkpoint(path, rank=0, grid=Grid(), map_location=CPU)
    assert torch.equal(state["model"]["w"], torch.full((3,), 7.0))
    assert meta["step"] == 7 and meta["grid"] == Grid().as_dict()


def test_keeps_only_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep=2)
    kept = sorted(p.name for p in checkpoint_root(tmp_path).glob("step_*"))
    assert kept == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path).name == "step_00000004"


def test_interrupted_save_leaves_the_previous_checkpoint_current(tmp_path):
    save(tmp_path, 3)
    partial = checkpoint_root(tmp_path) / ".tmp_step_00000004"
    partial.mkdir()
    (partial / "rank_00000.pt.part").write_bytes(b"truncated")
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    save(tmp_path, 4)  # a later save of the same step replaces the leftover
    assert latest_checkpoint(tmp_path).name == "step_00000004"
    assert not partial.exists()


def test_pointer_to_a_missing_checkpoint_is_an_error(tmp_path):
    save(tmp_path, 3)
    (checkpoint_root(tmp_path) / "latest").write_text("step_00000009")
    with pytest.raises(FileNotFoundError):
        latest_checkpoint(tmp_path)


def test_loading_on_another_grid_is_refused(tmp_path):
    path = save(tmp_path, 2, grid=Grid(x=2, z=2))
    meta = json.loads((path / "meta.json").read_text())
    assert meta["grid"] == {"data": 1, "x": 2, "y": 1, "z": 2}
    with pytest.raises(ValueError, match="grid"):
        load_checkpoint(path, rank=0, grid=Grid(data=4), map_location=CPU)


def test_rng_state_round_trip():
    state = rng_state(CPU)
    expected = torch.rand(5)
    torch.rand(3)
    set_rng_state(state, CPU)
    assert torch.equal(torch.rand(5), expected)
