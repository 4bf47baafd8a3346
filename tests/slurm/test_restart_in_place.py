"""Restarts in place (``submit/in_job.py``) on the real local cluster's ``wide`` partition.

One run of a 2-node x2 z2 grid with one spare node (3 nodes held, n1 left out so that the
batch script runs on n2, a node no fault touches) meets two real faults: a rank killed
with SIGKILL, then a node set DOWN with scontrol. Each is healed inside the same Slurm job
(a new srun step), with no sbatch after the launch's own two (the job and its recovery
job, counted by an sbatch on PATH that logs each call). The uninterrupted run is the same
config on machine=local, trained beside it. Over 60 s: 16 steps slowed to 1 s each, so
that the faults land mid-training, two restarts and the DOWN node's detection.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from axonn_launch.common import slurmtext
from axonn_launch.common.jobdir import read_record
from tests.conftest import run_launcher
from tests.slurm.test_faults import jobs_cli, rank_pids, sacct_state, wait_ended, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 16
TRAIN = [
    "grid.x=2", "grid.z=2", f"train.steps={STEPS}", "train.sample_tokens=0",
    "train.checkpoint_every=2", "preflight=false", "train.gemm_tuning=false", "force=true",
]  # fmt: skip
ON_SLURM = [
    "machine=slurm_local", "nodes=2", "machine.slurm.partition=wide",
    "+machine.slurm.extra_sbatch.exclude=n1", "recovery.spare_nodes=1", "wait=false",
]  # fmt: skip
SLOW = "slow@step2:1"  # every rank sleeps 1 s in each step from step 2 (the loss is unchanged)
VICTIM = "n3"  # the node set DOWN: only the wide partition holds it, so only this run


def sbatch_logger(folder: Path) -> Path:
    """A folder holding an ``sbatch`` that logs each call, then runs Slurm's."""
    real = subprocess.run(["which", "sbatch"], capture_output=True, text=True).stdout.strip()
    folder.mkdir()
    script = folder / "sbatch"
    log = folder / "calls.log"
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder


def metrics_step(job_dir: Path) -> int:
    path = job_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    return max((r["step"] for r in rows), default=0)


def restarts(job_dir: Path) -> list[dict]:
    return read_record(job_dir)["in_job"]["steps"]


@pytest.fixture(scope="module")
def healed(slurm_cluster, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("in_place")
    shim = sbatch_logger(root / "bin")
    job_dir = root / "run"
    launched = run_launcher(
        [*TRAIN, *ON_SLURM, f"hydra.run.dir={job_dir}"],
        cwd=root,
        path_prefix=str(shim),
        env={"AXONN_FAULT": SLOW},
        timeout=300,
    )
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    job_id = read_record(job_dir)["job_ids"][0]
    local = run_launcher([*TRAIN, "machine=local", f"hydra.run.dir={root / 'local'}"],
                         cwd=root, timeout=600)  # fmt: skip
    assert local.returncode == 0, local.stderr[-2000:]
    wait_until(lambda: metrics_step(job_dir) >= 5, 300, "step 5 (after checkpoint 4)")
    pids = wait_until(lambda: len(p := rank_pids(job_id)) == 4 and p, 60, "the 4 ranks")
    os.kill(pids[1], signal.SIGKILL)
    wait_until(lambda: len(restarts(job_dir)) == 1, 180, "the first restart in place")
    wait_until(lambda: metrics_step(job_dir) >= 9, 300, "step 9 after the restart")
    nodes_before = restarts(job_dir)[0]["nodes"]
    down = ["scontrol", "update", f"nodename={VICTIM}", "state=down", "reason=test_in_place"]
    subprocess.run(down, check=True, timeout=60)
    try:
        state = wait_ended(job_id, timeout_s=420)
    finally:
        back = ["scontrol", "update", f"nodename={VICTIM}", "state=resume"]
        subprocess.run(back, capture_output=True, timeout=60)  # an error if it is back already
    return {"dir": job_dir, "job_id": job_id, "state": state, "shim": shim,
            "local": root / "local", "nodes_before": nodes_before}  # fmt: skip


def final_loss(job_dir: Path) -> float:
    return json.loads((job_dir / "summary.json").read_text())["final_loss"]


def test_both_faults_heal_inside_one_job_to_the_uninterrupted_loss(healed):
    assert healed["state"] == "COMPLETED", sacct_state(healed["job_id"])
    assert final_loss(healed["dir"]) == final_loss(healed["local"])
    calls = (healed["shim"] / "calls.log").read_text().splitlines()
    assert len(calls) == 2 and "afternotok" in calls[1], calls  # the job, its recovery job


def test_sacct_shows_three_training_steps_the_last_on_the_spare(healed):
    command = ["sacct", "-n", "-P", "-o", "JobID,State,NodeList", "-j", healed["job_id"]]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    steps = [line.split("|") for line in out.stdout.splitlines()]
    numbered = [s for s in steps if s[0].partition(".")[2].isdigit()]  # not batch, not the job
    assert len(numbered) == 3, steps
    assert healed["nodes_before"] == ["n2", "n3"]  # the kill: the same nodes again
    last = slurmtext.expand_nodelist(numbered[-1][2])
    assert VICTIM not in last and "n4" in last, steps


def test_the_chain_records_two_attempts_in_place_by_class(healed):
    attempts = read_record(healed["dir"])["chain"]["attempts"]
    assert [(a["class"], a["action"], a["in_place"]) for a in attempts] == [
        ("rank_killed", "resume", True),
        ("node_failure", "resume_exclude", True),
    ], attempts
    assert attempts[1]["bad_nodes"] == [VICTIM] and VICTIM not in attempts[1]["next_nodes"]


def test_status_shows_one_run_of_three_attempts_and_the_time_to_recover(healed):
    result = jobs_cli("status", str(healed["dir"]), "--json", cwd=healed["dir"].parent)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row["attempts"] == 3 and row["failure"] == "completed", row
    assert len(row["goodput"]["ttr_s"]) == 2 and row["goodput"]["recovery_s"] > 0, row["goodput"]
    text = jobs_cli("status", str(healed["dir"]), cwd=healed["dir"].parent).stdout
    assert "3 attempts in 1 allocation" in text, text
