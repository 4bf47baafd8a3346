"""A job submitted before the package moved into folders, and requeued after the move,
still runs (``axonn_launch/job.py``).

Slurm runs a requeued job from the pickle submitit wrote when the job was submitted. The
test takes a running job, puts in place of its pickle the one the code of commit be55d50
wrote (``tests/fixtures/trainjob_before_relayout.pkl``: ``axonn_launch.job.TrainJob``, the
old module path), requeues the job with ``scontrol requeue``, and the job must run to its
end from that pickle.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import JobPaths, read_record
from tests.conftest import run_launcher
from tests.slurm.test_faults import sacct_state, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FIXTURE = Path(__file__).parents[1] / "fixtures" / "trainjob_before_relayout.pkl"
STEPS = 6
# n3 or n4: a rehearsal of the other Slurm worker fills n1 and n2 for a minute or more (8
# CPUs a node), and this job, submitted then and again when requeued, would wait for it
OFF_THE_DEBUG_NODES = [
    "machine.slurm.partition=wide",
    "+machine.slurm.extra_sbatch.exclude='n1,n2'",
]


def test_a_job_pickled_before_the_move_runs_when_requeued(slurm_cluster, tmp_path):
    job_dir = tmp_path / "job"
    result = run_launcher(
        ["machine=slurm_local", "grid.x=2", "nodes=1", f"train.steps={STEPS}",
         "train.sample_tokens=0", "preflight=false", "recovery=off", "wait=false",
         *OFF_THE_DEBUG_NODES, f"hydra.run.dir={job_dir}"],
        cwd=tmp_path, env={"AXONN_FAULT": "pause@step2:600"}, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    job_id = read_record(job_dir)["job_ids"][0]
    log = job_dir / "slurm" / job_id / f"{job_id}_0_log.out"
    wait_until(lambda: log.exists() and "injecting pause" in log.read_text(), 300, "the pause")
    submitted = job_dir / "slurm" / job_id / f"{job_id}_submitted.pkl"
    assert submitted.is_file()
    text = FIXTURE.read_text(encoding="latin-1").replace("@JOB_DIR@", str(job_dir))
    assert "caxonn_launch.job\nTrainJob" in text
    submitted.write_text(text, encoding="latin-1")
    subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True)

    def ended_starting_it_now() -> bool:
        state = sacct_state(job_id)[0]
        if state.startswith("PENDING"):  # a requeued job waits cred_expire for its begin time
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
        return state == "COMPLETED"

    wait_until(ended_starting_it_now, 600, "the requeued job to end", poll_s=2)
    summary = json.loads(JobPaths(job_dir).summary.read_text())
    assert summary["steps"] == STEPS
    restarts = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-D", "-o", "State", "-j", job_id],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert "REQUEUED" in restarts, restarts  # it did run again, from the old pickle
