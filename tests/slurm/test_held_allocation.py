"""Inside ``salloc -N 2``, a launch runs as a step of that allocation (allocation=auto): no
new job, job.json names the allocation, and the loss equals machine=local's. The login-node
checks (a grid too large for the allocation, allocation=new):
tests/submit/test_allocation_login.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TRAIN = ["grid.x=2", "grid.z=2", "train.steps=8", "train.sample_tokens=0", "preflight=false",
         "train.gemm_tuning=false"]  # fmt: skip


def last_loss(job_dir: Path) -> float:
    return json.loads((job_dir / "metrics.jsonl").read_text().splitlines()[-1])["loss"]


def sacct_rows(job_id: str) -> list[str]:
    out = subprocess.run(
        ["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    return [line for line in out.splitlines() if line.strip()]


def test_a_launch_inside_salloc_runs_as_its_step(slurm_cluster, local_run, tmp_path):
    step_dir = tmp_path / "step"
    launch = [sys.executable, "-m", "axonn_launch", "machine=slurm_local", *TRAIN,
              f"hydra.run.dir={step_dir}"]  # fmt: skip
    salloc = ["salloc", "-N", "2", "-p", slurm_cluster.partition, "--time=5", *launch]
    done = subprocess.run(salloc, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((step_dir / "job.json").read_text())
    (allocation,) = record["job_ids"]
    assert f"Granted job allocation {allocation}" in done.stderr  # the salloc's own job
    assert f"allocation: running as a step of Slurm job {allocation}" in done.stdout
    assert "submitted job" not in done.stdout and "recovery: job" not in done.stdout
    assert record["in_allocation"] is True and record["status"] == "completed"
    assert "recovery" not in record  # never chained
    rows = sacct_rows(allocation)  # the allocation and its one training step, no other job
    assert f"{allocation}.0|COMPLETED" in rows, rows

    # the local run is test_launcher_on_slurm.py's reference too, run once for both
    assert last_loss(step_dir) == last_loss(local_run(TRAIN))
