"""On the local Slurm cluster, a Slurm job outlives its launcher and holds no lock,
so a launch into a dir whose job.json names a job squeue still lists is refused in one line
naming that job; once the job is gone, the dir is one that holds a run (refused unless
``resume=true``). The job is held in the queue (``--begin``): no node is used."""

from __future__ import annotations

import subprocess

import pytest

from axonn_launch.common.jobdir import write_record_file
from tests.conftest import REPO, run_launcher
from tests.slurm.conftest import SlurmCluster, wait_for

pytestmark = pytest.mark.slurm


def squeue_lists(job_id: str) -> bool:
    done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    return bool(done.stdout.strip())


def test_a_launch_into_the_dir_of_a_queued_slurm_job_is_refused(
    slurm_cluster: SlurmCluster, tmp_path
):
    job = tmp_path / "job"
    job.mkdir()
    done = subprocess.run(
        ["sbatch", "--parsable", f"--partition={slurm_cluster.partition}", "--begin=now+3600",
         f"--output={tmp_path}/%j.out", "--wrap", "sleep 300"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    job_id = done.stdout.strip().split(";")[0]
    try:
        write_record_file(job, {"job_ids": [job_id], "status": "submitted", "scheduler": "slurm"})
        args = ["machine=slurm_local", "model=gpt_tiny", f"hydra.run.dir={job}"]
        live = run_launcher(args, cwd=REPO)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60, check=False)
    assert live.returncode == 2, live.stdout[-2000:] + live.stderr[-2000:]
    assert live.stderr.splitlines() == [
        f"error: job dir {job} is in use by Slurm job {job_id} (PENDING): a second launch into"
        f" it is refused, nothing written; follow it with python -m axonn_launch.jobs status"
        f" {job}, or launch into another hydra.run.dir"
    ]
    assert sorted(p.name for p in job.iterdir()) == ["job.json"]
    wait_for(lambda: not squeue_lists(job_id), 60, "the cancelled job to leave the queue")
    ended = run_launcher(args, cwd=REPO)
    assert ended.returncode == 2 and len(ended.stderr.splitlines()) == 1, ended.stderr
    assert f"holds a run already (job {job_id}, submitted)" in ended.stderr
