"""The controller and the accounting daemon both stopped while a job runs (the cluster's
own ``stop_pidfile`` on slurmctld and slurmdbd, ``start.sh`` to bring them back): ``jobs
status`` says in one line that Slurm is unreachable, shows the job's last known state
with its age and never ENDED; its follower (``wait=true``) says once that accounting is
unreachable, with none of submitit's warnings; once the daemons are back the job and its
chain finish (chain.state done). One 2-rank gpt_tiny job whose steps take 2 s; over 60 s:
the job's start, the daemons' restart (start.sh waits for the nodes) and its end. It
holds the cluster alone (``cluster_whole``: the other worker's Slurm modules would fail
on a stopped controller) from the job's start until the daemons are back, not while the
job finishes (measured alone: 43 s of the test's 74 s); so it runs in the node-down
scope, after that scope's other files, and waits for the other Slurm scope to finish the
module it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import read_record
from tests.cli_server import run_module
from tests.conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SCRIPTS = REPO / "machines" / "slurm_local"
TRAIN = ["machine=slurm_local", "grid.x=2", "train.steps=30", "train.sample_tokens=0",
         "train.checkpoint_every=10", "preflight=false", "train.eval_batches=0",
         "wait=true"]  # fmt: skip


def daemons(action: str) -> None:
    """``stop``: slurmctld and slurmdbd stopped as stop.sh stops them; ``start``: start.sh."""
    if action == "stop":
        script = (f"source {SCRIPTS}/lib.sh; take_lock; stop_pidfile $RUN_DIR/slurmctld.pid"
                  " slurmctld; stop_pidfile $RUN_DIR/slurmdbd.pid slurmdbd")  # fmt: skip
        command = ["bash", "-c", script]
    else:
        command = ["bash", str(SCRIPTS / "start.sh")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(1)
    return found


def steps_logged(job_dir: Path) -> int:
    metrics = job_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def status(job_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_module("axonn_launch.jobs", ["status", *extra, str(job_dir)], cwd=job_dir.parent,
                      timeout=300)  # fmt: skip


def test_controller_and_accounting_down_is_unreachable_not_ended(
    slurm_cluster, cluster_whole, tmp_path
):
    job_dir = tmp_path / "run"
    out = open(tmp_path / "follower.out", "w")  # noqa: SIM115 (closed below)
    follower = subprocess.Popen(
        [sys.executable, "-m", "axonn_launch", *TRAIN, f"hydra.run.dir={job_dir}"], cwd=tmp_path,
        stdout=out, stderr=subprocess.STDOUT, env={**os.environ,
                                                   "AXONN_FAULT": "slow@step3:2"},
    )  # fmt: skip
    try:
        wait_for(lambda: steps_logged(job_dir) >= 3, 300, "step 3")
        assert "RUNNING" in status(job_dir).stdout  # seen running: the state to keep
        recorded = read_record(job_dir)["status"]
        daemons("stop")
        try:
            shown = status(job_dir)
            before = steps_logged(job_dir)
            wait_for(lambda: steps_logged(job_dir) > before, 60, "a step while Slurm is down")
            again = status(job_dir)
        finally:
            daemons("start")
        cluster_whole()  # the daemons are back: the other Slurm modules may go on
        for said in (shown, again):
            assert said.returncode == 0, said.stderr
            lines = said.stdout.splitlines()
            assert sum(ln.startswith("Slurm unreachable (") for ln in lines) == 1, said.stdout
            assert "RUNNING?" in said.stdout and "last seen RUNNING" in said.stdout, said.stdout
            assert "ENDED" not in said.stdout and "(action:" not in said.stdout, said.stdout
        assert read_record(job_dir)["status"] == recorded  # not settled from an absence
        assert follower.wait(timeout=420) == 0, (tmp_path / "follower.out").read_text()[-3000:]
    finally:
        if follower.poll() is None:
            follower.kill()
        out.close()
    console = (tmp_path / "follower.out").read_text()
    assert "Bypassing" not in console, console[-3000:]
    assert console.count("accounting unreachable") <= 1, console[-3000:]
    (row,) = json.loads(status(job_dir, "--json").stdout)
    assert (row["state"], row["step"], row["run_state"]) == ("COMPLETED", 30, "done"), row
    assert read_record(job_dir)["chain"]["state"] == "done"
