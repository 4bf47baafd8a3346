"""On the local Slurm cluster, ``jobs stop`` acts only on a job that is the dir's.

A copied job dir whose job.json was edited to name someone else's job (a ``sleep`` that
runs, named ``wrap``, its output elsewhere) is refused in one line naming the job and what
differs, and that job keeps running; one that has the launcher's job name but writes its
output outside the dir is refused too. Nothing is written into the dir. (``jobs stop`` of
the launcher's own queued job is tests/slurm/test_repeat_on_slurm.py's.)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import JobPaths, write_record_file
from tests.cli_server import run_module
from tests.conftest import REPO
from tests.records.test_records_schema import local_record, said
from tests.slurm.conftest import SlurmCluster, wait_for

pytestmark = pytest.mark.slurm
NAME = "gpt_tiny-slurm_local"  # what a launch with machine=slurm_local is named


def sbatch(*options: str) -> str:
    done = subprocess.run(["sbatch", "--parsable", *options, "--wrap", "sleep 300"],
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return done.stdout.strip().split(";")[0]


def squeue_state(job_id: str) -> str:
    done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    return done.stdout.strip()


@pytest.fixture(scope="module")
def foreign(slurm_cluster: SlurmCluster, tmp_path_factory) -> dict:
    """Two jobs the launcher did not submit: ``sleep`` running as ``wrap``, and one queued
    for an hour under the launcher's name; both write their output to ``elsewhere/``."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    out = f"--output={elsewhere}/%j.out"
    found = {"elsewhere": elsewhere}
    try:
        found["running"] = sbatch(f"--partition={slurm_cluster.partition}", "--job-name=wrap",
                                  out, f"--chdir={elsewhere}")  # fmt: skip
        found["queued"] = sbatch(f"--partition={slurm_cluster.partition}", f"--job-name={NAME}",
                                 out, "--begin=now+3600")  # fmt: skip
        wait_for(lambda: squeue_state(found["running"]) == "RUNNING", 120, "the sleep to run")
        yield found
    finally:
        ids = [found[k] for k in ("running", "queued") if k in found]
        subprocess.run(["scancel", *ids], capture_output=True, timeout=60, check=False)


def copied_dir(root: Path, job_id: str) -> Path:
    """A job dir as a copy of a launch's would be, its job.json edited to name ``job_id``."""
    job_dir = root / "copied"
    job_dir.mkdir()
    record = local_record(job_dir, job_id, "running") | {"name": NAME, "machine": "slurm_local",
                                                        "scheduler": "slurm"}  # fmt: skip
    write_record_file(job_dir, record)
    return job_dir


def stop(job_dir: Path) -> subprocess.CompletedProcess:
    return run_module("axonn_launch.jobs", ["stop", str(job_dir)], cwd=REPO, timeout=120)


def test_stop_refuses_a_job_that_is_not_the_dirs_and_it_keeps_running(foreign, tmp_path):
    job_id = foreign["running"]
    job_dir = copied_dir(tmp_path, job_id)
    before = JobPaths(job_dir).record.read_text()
    refused = stop(job_dir)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stdout == "", refused.stdout
    assert said(refused.stderr) == [
        f"error: job {job_id} is not {job_dir}'s: its name is 'wrap', not '{NAME}' and its "
        f"output goes to {foreign['elsewhere']}/%j.out, outside this dir; nothing cancelled"
    ], refused.stderr
    assert JobPaths(job_dir).record.read_text() == before  # no chain marked stopped
    assert squeue_state(job_id) == "RUNNING"


def test_stop_refuses_a_job_with_the_launchers_name_but_its_output_elsewhere(foreign, tmp_path):
    job_id = foreign["queued"]
    job_dir = copied_dir(tmp_path, job_id)
    refused = stop(job_dir)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = said(refused.stderr)
    assert line.startswith(f"error: job {job_id} is not {job_dir}'s: its output goes to "), line
    assert "its name" not in line, line
    assert squeue_state(job_id) == "PENDING"
    assert "chain" not in json.loads(JobPaths(job_dir).record.read_text())
