"""Checkpoints are verified before they are trusted; a resume survives a disk that filled.

One uninterrupted 4-rank run (x=2 z=2, a checkpoint every 2 of 8 steps, all kept) is the
reference. Each resume test copies its checkpoints and metrics into a new job as they
would be after a crash at step 7 (``latest`` names step 6), damages them as a fault
would, resumes with real ranks to step 8, and compares with the reference: a damaged
step 6 falls back to step 4, names the damage in one line and in summary.json, and ends
on the reference's final loss exactly (same grid, same order of every reduction).
The unit tests run the verification on single-process checkpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from axonn_launch.common.grid import Grid
from axonn_launch.train.checkpoint.manager import (
    Checkpointer,
    _prune,
    checkpoint_problem,
    checkpoint_root,
    choose_checkpoint,
    resume_point,
)
from axonn_launch.train.parallel.shards import Piece, ShardSpec
from axonn_launch.train.run import truncate_metrics
from tests.train.test_loop import launch, metrics, write_job

GRID = Grid(x=2, z=2)
JOB = {"steps": 8, "checkpoint_every": 2, "keep_checkpoints": 0, "data": "synthetic"}
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def step_dir(job: Path, step: int) -> Path:
    return checkpoint_root(job) / f"step_{step:08d}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, shared by the resume tests (which only copy from it)."""
    job = tmp_path_factory.mktemp("reference")
    write_job(job, GRID, **JOB)
    launch(job, 4, "axonn_launch.train")
    return job


def crashed_after_step_7(reference: Path, job: Path) -> Path:
    """A copy of ``reference`` as a crash after step 7 leaves it: checkpoints up to step 6
    (``latest`` names it) and metrics rows up to step 7."""
    write_job(job, GRID, **JOB)
    shutil.copytree(checkpoint_root(reference), checkpoint_root(job))
    shutil.rmtree(step_dir(job, 8))
    (checkpoint_root(job) / "latest").write_text("step_00000006")
    rows = (reference / "metrics.jsonl").read_text().splitlines()[:7]
    (job / "metrics.jsonl").write_text("".join(row + "\n" for row in rows))
    return job


def resume_and_compare(reference: Path, job: Path) -> tuple[dict, list[str]]:
    """Resume ``job`` to the end; its losses must equal the reference's exactly."""
    outputs = launch(job, 4, "axonn_launch.train")
    expected, got = metrics(reference), metrics(job)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    summary = json.loads((job / "summary.json").read_text())
    reference_summary = json.loads((reference / "summary.json").read_text())
    assert summary["final_loss"] == reference_summary["final_loss"]
    assert (checkpoint_root(job) / "latest").read_text() == "step_00000008"
    return summary, outputs


def damage_lines(outputs: list[str]) -> list[list[str]]:
    return [[line for line in out.splitlines() if "is damaged" in line] for out in outputs]


def largest_distcp(step: Path) -> Path:
    return max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.slow
def test_truncated_distcp_falls_back_to_the_previous_step(reference, tmp_path):
    job = crashed_after_step_7(reference, tmp_path / "job")
    damaged = largest_distcp(step_dir(job, 6))
    size = damaged.stat().st_size
    with open(damaged, "r+b") as handle:
        handle.truncate(size // 2)
    summary, outputs = resume_and_compare(reference, job)
    fallback = summary["checkpoint_fallback"]
    assert fallback["from_step"] == 6 and fallback["to_step"] == 4
    assert fallback["reason"] == (
        f"step_00000006/{damaged.name}: {size // 2} bytes, metadata needs {size}"
    )
    assert summary["resumed_from"] == 4
    lines = damage_lines(outputs)
    assert lines[1:] == [[], [], []] and len(lines[0]) == 1  # one line, on rank 0
    assert lines[0][0].endswith(
        f"checkpoint step_00000006 is damaged ({fallback['reason']}); resuming from step_00000004"
    )
    assert "Traceback" not in "".join(outputs)


@pytest.mark.slow
def test_deleted_metadata_falls_back_to_the_previous_step(reference, tmp_path):
    job = crashed_after_step_7(reference, tmp_path / "job")
    (step_dir(job, 6) / ".metadata").unlink()
    summary, outputs = resume_and_compare(reference, job)
    assert summary["checkpoint_fallback"] == {
        "from_step": 6,
        "to_step": 4,
        "reason": "step_00000006/.metadata: missing",
    }
    lines = damage_lines(outputs)
    assert lines[1:] == [[], [], []] and len(lines[0]) == 1
    assert lines[0][0].endswith(
        "checkpoint step_00000006 is damaged (step_00000006/.metadata: missing); "
        "resuming from step_00000004"
    )


@pytest.mark.slow
def test_partial_metrics_line_and_stale_save_are_cleaned_on_resume(reference, tmp_path):
    """The disk filled during step 8's save: a row cut mid-line, a ``.tmp_step_*`` left."""
    job = crashed_after_step_7(reference, tmp_path / "job")
    row_8 = (reference / "metrics.jsonl").read_text().splitlines()[7]
    with open(job / "metrics.jsonl", "a") as handle:
        handle.write(row_8[: len(row_8) // 2])
    stale = checkpoint_root(job) / ".tmp_step_00000008"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"cut off")
    summary, outputs = resume_and_compare(reference, job)
    assert summary["resumed_from"] == 6 and "checkpoint_fallback" not in summary
    assert not list(checkpoint_root(job).glob(".tmp_step_*"))
    assert "metrics.jsonl: dropped 1 line(s) cut off mid-write" in outputs[0]


# ---------------------------------------------------------------------------------------
# One process: the verification itself

SPECS = {"w": ShardSpec((3, 4), (Piece(0, (0, 0), (3, 4)),), writes=True)}


def save_steps(job: Path, *steps: int, keep: int = 0) -> None:
    checkpointer = Checkpointer(job, rank=0, keep=keep)
    for step in steps:
        checkpointer.save(step, {"w": torch.full((12,), float(step))}, SPECS, {"grid": {}})
    checkpointer.wait()


def test_a_complete_step_has_no_problem_and_each_damage_is_named(tmp_path):
    save_steps(tmp_path, 1)
    step = step_dir(tmp_path, 1)
    assert checkpoint_problem(step) is None
    data = next(step.glob("*.distcp"))
    data.rename(data.with_suffix(".moved"))
    assert checkpoint_problem(step) == f"step_00000001/{data.name}: missing"
    data.with_suffix(".moved").rename(data)
    (step / ".metadata").write_bytes((step / ".metadata").read_bytes()[:20])
    assert checkpoint_problem(step).startswith("step_00000001/.metadata: unreadable (")
    (step / "meta.json").unlink()
    assert checkpoint_problem(step) == "step_00000001/meta.json: missing"
    assert checkpoint_problem(step_dir(tmp_path, 2)) == "step_00000002: missing"


def test_no_complete_step_starts_from_zero_and_drops_the_pointer(tmp_path):
    save_steps(tmp_path, 1, 2)
    for step in (1, 2):
        (step_dir(tmp_path, step) / ".metadata").unlink()
    path, record = choose_checkpoint(checkpoint_root(tmp_path))
    assert path is None
    assert record == {"from_step": 2, "to_step": 0, "reason": "step_00000002/.metadata: missing"}
    assert not (checkpoint_root(tmp_path) / "latest").exists()


def test_a_pointer_to_a_missing_step_falls_back(tmp_path):
    save_steps(tmp_path, 1, 2)
    (checkpoint_root(tmp_path) / "latest").write_text("step_00000009")
    path, record = resume_point(tmp_path, rank=0)
    assert path == step_dir(tmp_path, 2)
    assert record == {"from_step": 9, "to_step": 2, "reason": "step_00000009: missing"}
    assert (checkpoint_root(tmp_path) / "latest").read_text() == "step_00000002"


def test_resume_removes_stale_saves_before_training(tmp_path):
    """Rank 0 removes ``.tmp_step_*`` at resume, not only at the next save's prune."""
    save_steps(tmp_path, 1)
    stale = checkpoint_root(tmp_path) / ".tmp_step_00000002"
    stale.mkdir()
    (stale / ".metadata").write_bytes(b"cut off")
    path, record = resume_point(tmp_path, rank=0)
    assert path == step_dir(tmp_path, 1) and record is None
    assert not stale.exists()


def test_prune_keeps_the_fallback_step_in_use(tmp_path):
    """After a fallback from damaged step 4 to step 2, a save of step 3 with keep=1 keeps
    step 3 (``latest``), not the damaged newer step 4."""
    save_steps(tmp_path, 2, 4)
    (step_dir(tmp_path, 4) / ".metadata").unlink()
    path, _ = resume_point(tmp_path, rank=0)
    assert path == step_dir(tmp_path, 2)
    _prune(checkpoint_root(tmp_path), keep=1)  # the fallback step is in use: kept
    assert step_dir(tmp_path, 2).exists()
    save_steps(tmp_path, 3, keep=1)
    assert (checkpoint_root(tmp_path) / "latest").read_text() == "step_00000003"
    assert checkpoint_problem(step_dir(tmp_path, 3)) is None
    assert not step_dir(tmp_path, 2).exists()


def test_truncate_metrics_drops_rows_after_the_step_and_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path.write_text("\n".join(rows) + "\n" + rows[2][:9])
    truncate_metrics(path, 2)
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"
