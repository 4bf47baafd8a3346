"""``jobs resubmit`` says which step a new attempt starts from, and warns
when its exclusions leave the partition fewer nodes than the job needs. Through the command
a user types, on job directories written as a 2-node Slurm job leaves them, with a fake
``sacct`` (the job's end) and ``sinfo`` (the partition) on PATH."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.cli_server import run_module
from tests.conftest import REPO
from tests.fake_slurm import QUIET, failing, fake_tools, on_path, printing

NCCL_ERROR = (
    "[rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356,"
    " unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
)
PEER_CLOSED = (
    "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553]"
    " Connection closed by peer [127.0.0.1]:47015.\n"
)


def failed_job(root: Path, name: str, job_id: str, *, checkpoint_step: int | None) -> Path:
    """A 2-node, 2-tasks-per-node job whose task 1 (on the first node) logged an NCCL error
    and the others lost their peer: a collective failure that points at the first node."""
    job_dir = root / name
    logs = job_dir / "slurm" / job_id
    logs.mkdir(parents=True)
    record = {
        "name": name, "job_dir": str(job_dir), "job_ids": [job_id], "machine": "slurm_local",
        "scheduler": "slurm", "model": "gpt_tiny", "grid": {"data": 2, "x": 2, "y": 1, "z": 1},
        "nodes": 2, "tasks_per_node": 2, "steps": 20, "attempt": 1, "lineage": [],
        "command_line": ["axonn_launch", "machine=slurm_local", "grid.x=2", "grid.data=2"],
        "status": "submitted",
    }  # fmt: skip
    (job_dir / "job.json").write_text(json.dumps(record))
    for task in range(4):
        (logs / f"{job_id}_{task}_log.err").write_text(NCCL_ERROR if task == 1 else PEER_CLOSED)
        (logs / f"{job_id}_{task}_log.out").write_text("")
    if checkpoint_step is not None:
        step_dir = job_dir / "checkpoints" / f"step_{checkpoint_step:08d}"
        step_dir.mkdir(parents=True)
        (step_dir / "meta.json").write_text(json.dumps({"step": checkpoint_step}))
        (job_dir / "checkpoints" / "latest").write_text(step_dir.name)
    return job_dir


def tools(tmp_path: Path, *, sacct: str, sinfo: str | None) -> dict[str, str]:
    """An environment whose sacct prints ``sacct`` and whose sinfo prints ``sinfo`` (or
    fails, as on a computer without Slurm, when None)."""
    fail = failing("sinfo: error: Unable to contact slurm controller")
    tools = {"sacct": printing(sacct), "squeue": QUIET,
             "sinfo": fail if sinfo is None else printing(sinfo)}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return {**env, "PATH": on_path(fake_tools(tmp_path / "bin", tools))}


def resubmit_dry_run(root: Path, env: dict[str, str], *overrides: str):
    args = ["resubmit", str(root), "--dry-run", *overrides]
    return run_module("axonn_launch.jobs", args, cwd=REPO, env=env, timeout=120)


def test_an_exclusion_that_leaves_too_few_nodes_warns_and_step_0_is_said(tmp_path):
    root = tmp_path / "jobs"
    failed_job(root, "collective", "201", checkpoint_step=None)
    env = tools(tmp_path, sacct="201|FAILED|1:0|n[1-2]", sinfo="debug*|n[1-2]")
    proc = resubmit_dry_run(root, env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("would resubmit 201 (collective_failure)")
    assert "+machine.slurm.extra_sbatch.exclude=n1" in out[0]
    assert out[1].strip() == "restarts from step 0: no checkpoint was saved"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, proc.stderr
    assert "excluding n1 leaves 1 of the 2 nodes of partition debug" in warnings[0]
    assert "the job needs 2: it can never start" in warnings[0]
    assert "resubmit with nodes=1 and a grid" in warnings[0]  # what would run instead
    assert not (root / "collective_attempt2").exists()


def test_a_partition_with_room_gives_no_warning_and_the_checkpoint_step_is_said(tmp_path):
    root = tmp_path / "jobs"
    failed_job(root, "collective", "202", checkpoint_step=12)
    env = tools(tmp_path, sacct="202|FAILED|1:0|n[1-2]", sinfo="debug*|n[1-3]\nother|m[1-8]")
    proc = resubmit_dry_run(root, env)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert "exclude=n1" in lines[0]
    assert lines[1].strip() == "resumes from step 12 (checkpoints/step_00000012)"
    # a smaller job fits beside the excluded node: nodes=1 is checked, not the old 2
    env = tools(tmp_path / "b", sacct="202|FAILED|1:0|n[1-2]", sinfo="debug*|n[1-2]")
    proc = resubmit_dry_run(root, env, "nodes=1", "grid.data=1")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


def test_when_sinfo_cannot_tell_resubmit_says_so(tmp_path):
    root = tmp_path / "jobs"
    failed_job(root, "collective", "203", checkpoint_step=None)
    proc = resubmit_dry_run(root, tools(tmp_path, sacct="203|FAILED|1:0|n[1-2]", sinfo=None))
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "cannot tell whether enough nodes are left" in warnings[0]
    assert "sinfo does not list the default partition here" in warnings[0]
    assert "would resubmit 203" in proc.stdout
