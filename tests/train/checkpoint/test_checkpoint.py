"""Atomic DCP checkpoints in one process: the latest pointer, pruning, leftovers, faults."""

from __future__ import annotations

import pytest
import torch

from axonn_launch.train.checkpoint.manager import (
    FORMAT,
    Checkpointer,
    checkpoint_root,
    latest_checkpoint,
    load_state,
    parse_fault,
    read_meta,
    rng_state,
    set_rng_state,
)
from axonn_launch.train.parallel.shards import Piece, ShardSpec

CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
# a (3 x 4) tensor whose flat shard is stored as rows 1..2 then row 0
SPECS = {"w": ShardSpec((3, 4), (Piece(0, (1, 0), (2, 4)), Piece(8, (0, 0), (1, 4))), writes=True)}


def state(step: int) -> dict:
    return {"w": torch.arange(12.0) + 100 * step, "note": f"step {step}"}


def save(job_dir, step, keep=2, asynchronous=True):
    checkpointer = Checkpointer(job_dir, rank=0, keep=keep, asynchronous=asynchronous)
    checkpointer.save(step, state(step), SPECS, {"grid": {"data": 1, "x": 1, "y": 1, "z": 1}})
    return checkpointer.wait()


def test_no_checkpoint_means_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("asynchronous", [True, False])
def test_save_then_load_round_trip(tmp_path, asynchronous):
    path = save(tmp_path, 7, asynchronous=asynchronous)
    assert latest_checkpoint(tmp_path) == path and path.name == "step_00000007"
    meta = read_meta(path)
    assert meta["step"] == 7 and meta["format"] == FORMAT
    loaded = {"w": torch.zeros(12), "note": ""}
    assert load_state(path, loaded, SPECS) > 0
    assert torch.equal(loaded["w"], state(7)["w"]) and loaded["note"] == "step 7"
    # read in natural order as one box: rows 0, 1, 2
    natural = {"w": torch.zeros(12)}
    load_state(path, natural, {"w": ShardSpec((3, 4), (Piece(0, (0, 0), (3, 4)),), True)})
    expected = torch.cat([state(7)["w"][8:], state(7)["w"][:8]])
    assert torch.equal(natural["w"], expected)


def test_the_saved_state_is_a_snapshot(tmp_path):
    checkpointer = Checkpointer(tmp_path, rank=0, keep=2)
    live = state(1)
    checkpointer.save(1, live, SPECS, {"grid": {}})
    live["w"].fill_(-1.0)  # training goes on while the save is written
    path = checkpointer.wait()
    loaded = {"w": torch.zeros(12), "note": ""}
    load_state(path, loaded, SPECS)
    assert torch.equal(loaded["w"], state(1)["w"])


def test_keeps_only_the_newest(tmp_path):
    checkpointer = Checkpointer(tmp_path, rank=0, keep=2)
    for step in (1, 2, 3, 4):
        checkpointer.save(step, state(step), SPECS, {"grid": {}})
    checkpointer.wait()
    kept = sorted(p.name for p in checkpoint_root(tmp_path).glob("step_*"))
    assert kept == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path).name == "step_00000004"


def test_interrupted_save_leaves_the_previous_checkpoint_current(tmp_path):
    save(tmp_path, 3)
    partial = checkpoint_root(tmp_path) / ".tmp_step_00000004"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"truncated")
    (partial / ".metadata").write_bytes(b"complete DCP files, but never published")
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    save(tmp_path, 4)  # a later save of the same step replaces the leftover
    assert latest_checkpoint(tmp_path).name == "step_00000004"
    assert not partial.exists()


def test_pointer_to_a_missing_checkpoint_is_an_error(tmp_path):
    save(tmp_path, 3)
    (checkpoint_root(tmp_path) / "latest").write_text("step_00000009")
    with pytest.raises(FileNotFoundError):
        latest_checkpoint(tmp_path)


def test_rng_state_round_trip():
    state = rng_state(CPU)
    expected = torch.rand(5)
    torch.rand(3)
    set_rng_state(state, CPU)
    assert torch.equal(torch.rand(5), expected)


def test_fault_specification():
    assert parse_fault(None) is None and parse_fault("") is None
    assert parse_fault("write@save3:rank1") == ("write", 3, 1)
    assert parse_fault("rename@save2") == ("rename", 2, 0)
    with pytest.raises(ValueError, match="AXONN_CHECKPOINT_FAULT='explode@save1'"):
        parse_fault("explode@save1")
