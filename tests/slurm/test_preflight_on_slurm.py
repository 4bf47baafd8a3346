"""The preflight on the real local Slurm cluster: a 2-node job whose node n2 is
slowed on purpose (``AXONN_FAULT=slow@preflight:node=n2``: its GEMMs do 8x the work) stops
before training, names n2 in its log, in job.json and in ``jobs status``; ``jobs
resubmit`` submits a job that Slurm records as excluding n2, and that one passes its own
preflight and trains on n1.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.conftest import run_launcher
from tests.slurm.test_faults import jobs_cli, sacct_state, status_of, tail_logs, wait_ended

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 4
TRAIN = ["machine=slurm_local", "grid.x=2", "grid.z=2", f"train.steps={STEPS}",
         "train.sample_tokens=0", "recovery=off"]  # fmt: skip


def excluded_nodes(job_id: str) -> str:
    """Slurm's own record of the job's --exclude (``scontrol show job``: ExcNodeList)."""
    out = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout
    found = re.search(r"\bExcNodeList=(\S+)", out)
    return found.group(1) if found else ""


def test_a_slowed_node_is_named_and_resubmit_excludes_it(slurm_cluster, tmp_path):
    job_dir = tmp_path / "slowed"
    launched = run_launcher(
        [*TRAIN, f"hydra.run.dir={job_dir}"],
        cwd=tmp_path,
        env={"AXONN_FAULT": "slow@preflight:node=n2"},
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert "preflight  on:" in launched.stdout  # on by default on a Slurm machine
    record = json.loads((job_dir / "job.json").read_text())
    job_id = record["job_ids"][0]
    assert record["nodes"] == 2
    state = wait_ended(job_id)
    assert state.startswith("FAILED"), (state, tail_logs(job_dir))
    assert sacct_state(job_id)[1] == "n[1-2]"

    log = (job_dir / "slurm" / job_id / f"{job_id}_0_log.out").read_text()
    assert "preflight: problem: slow nodes n2: rank 2 (n2) GEMM" in log, log[-3000:]
    assert not (job_dir / "metrics.jsonl").exists()  # stopped before the first step
    record = json.loads((job_dir / "job.json").read_text())
    assert record["slow_nodes"] == ["n2"]
    assert record["preflight"]["job_id"] == job_id and record["preflight"]["stopped"]
    assert sorted(record["preflight"]["slow_ranks"]) == ["2", "3"]  # both ranks of n2

    row = status_of(job_dir)
    assert (row["failure"], row["slow_nodes"], row["bad_nodes"]) == ("node_failure", ["n2"], ["n2"])
    shown = jobs_cli("status", str(job_dir), cwd=tmp_path)
    assert f"{job_id}: preflight stopped the job: slow nodes n2" in shown.stdout, shown.stdout

    again = jobs_cli("resubmit", str(job_dir), "grid.z=1", cwd=tmp_path)  # fits on n1 alone
    assert again.returncode == 0 and f"resubmitted {job_id} " in again.stdout, again.stdout
    new_dir = job_dir.with_name("slowed_attempt2")
    new = json.loads((new_dir / "job.json").read_text())
    new_id = new["job_ids"][0]
    assert excluded_nodes(new_id) == "n2"  # asked before the job ends: Slurm's own record
    assert "--exclude=n2" in (new_dir / "submission.sh").read_text()
    assert new["excluded_nodes"] == ["n2"]
    state = wait_ended(new_id)
    assert state == "COMPLETED", (state, tail_logs(new_dir))
    assert sacct_state(new_id)[1] == "n1"
    passed = json.loads((new_dir / "job.json").read_text())["preflight"]
    assert passed["job_id"] == new_id and passed["passed"] and passed["slow_nodes"] == []
