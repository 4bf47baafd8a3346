"""Fail fast on the real cluster: a broken set-up line ends the job before srun starts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from axonn_launch.common import slurmtext
from axonn_launch.scheduler.slurm_queries import sacct_command
from tests.conftest import run_launcher

from .conftest import SlurmCluster, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

MESSAGE = "axonn_launch: setup line 2 failed (exit 3): (exit 3); srun not started"


def steps(job_id: str) -> dict[str, str]:
    """Every sacct line of the job (allocation and steps): JobID -> State."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return dict(line.split("|", 1) for line in out.splitlines() if line.strip())


def test_failing_setup_line_fails_the_job_with_its_text_and_no_srun_step(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    setup = "+machine.setup=['true','(exit 3)','touch reached_line_3']"
    result = run_launcher(
        [
            "machine=slurm_local",
            "recovery=off",
            "grid.x=2",
            "grid.z=2",
            "train.steps=2",
            "machine.slurm.time_min=2",
            setup,
            "wait=true",
            f"hydra.run.dir={job_dir}",
        ],
        cwd=tmp_path,
        timeout=200,
    )
    record = json.loads((job_dir / "job.json").read_text())
    (job_id,) = record["job_ids"]
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert record["status"] == "failed" and record["slurm_state"] == "FAILED"
    # the batch script's stderr is task 0's error log; follow() streamed it to the user too
    err_log = job_dir / "slurm" / job_id / f"{job_id}_0_log.err"
    assert MESSAGE in err_log.read_text()
    assert MESSAGE in result.stdout
    assert not (tmp_path / "reached_line_3").exists()
    # sacct: the allocation FAILED with the script's exit code; batch/extern steps, no srun step
    lines = wait_for(
        lambda: (rows := steps(job_id)).get(f"{job_id}.batch", "").startswith("FAILED") and rows,
        60,
        f"sacct to record the batch step of job {job_id}",
    )
    assert lines[job_id] == "FAILED"
    sacct = subprocess.run(
        sacct_command([job_id]), capture_output=True, text=True, timeout=30, check=True
    )
    row = slurmtext.parse_sacct(sacct.stdout)[job_id]  # NodeList may still be settling
    assert (row.state, row.exit_code) == ("FAILED", "1:0")
    assert set(lines) <= {job_id, f"{job_id}.batch", f"{job_id}.extern"}
    assert not (job_dir / "slurm" / job_id / f"{job_id}_0_result.pkl").exists()
