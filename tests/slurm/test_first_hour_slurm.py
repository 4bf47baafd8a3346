"""A submission the real sbatch refuses: one line, exit code 1, and a
job.json with status "refused" that ``jobs status`` lists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.journeys import test_first_hour as first_hour
from tests.slurm.conftest import SlurmCluster

pytestmark = pytest.mark.slurm


def run(module: str, *args: str, cwd: Path, env: dict | None = None):
    return first_hour.run(module, *args, cwd=cwd, env=env)


REFUSED = ("machine=slurm_local", "machine.slurm.partition=nope", "hydra.run.dir=jobs/refused")


def test_a_refused_sbatch_is_one_line_and_a_refused_record(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    proc = run("axonn_launch", *REFUSED, cwd=tmp_path)
    job_dir = tmp_path / "jobs" / "refused"
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "error: sbatch refused the job on slurm_local: invalid partition specified: nope;"
        " Batch job submission failed: Invalid partition name specified; fix the"
        " machine.slurm.* setting it names and launch again"
        f" (recorded in {job_dir}/job.json)"
    ]
    record = json.loads((job_dir / "job.json").read_text())
    assert record["status"] == "refused" and record["job_ids"] == []
    assert record["error"] == (
        "invalid partition specified: nope; Batch job submission failed: Invalid partition"
        " name specified"
    )
    status = run("axonn_launch.jobs", "status", "--json", "jobs", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    (row,) = json.loads(status.stdout)
    assert row["state"] == "REFUSED" and row["reason"] == f"sbatch refused it: {record['error']}"
    table = run("axonn_launch.jobs", "status", "jobs", cwd=tmp_path).stdout.splitlines()
    assert "REFUSED" in table[1].split()


def test_a_refused_sbatch_shows_the_traceback_when_asked(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    proc = run("axonn_launch", *REFUSED, cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1 and "FailedJobError" in proc.stderr
    record = json.loads((tmp_path / "jobs" / "refused" / "job.json").read_text())
    assert record["status"] == "refused"
