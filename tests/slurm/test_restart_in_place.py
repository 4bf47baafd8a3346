"""Restarts in place (``submit/in_job.py``) on the real local cluster's ``wide`` partition.

One run of a 2-node x2 z2 grid with one spare node (3 nodes held, n1 left out so that the
batch script runs on n2, a node no fault touches) meets three real faults: a rank killed
with SIGKILL, then a node set DOWN with scontrol (the spare takes its place), then, with
no spare left, the spare set DOWN too: the grid shrinks in place to n2 alone
(``recovery.on_fewer_nodes=shrink``). Each is healed inside the same Slurm job (a new srun
step), with no sbatch after the launch's own two (the job and its recovery job, counted by
an sbatch on PATH that logs each call). The uninterrupted run is the same config on
machine=local, trained beside it (or before it: test_lost_batch_host.py's 2-node grid is
compared with the same run, made once for both by ``local_run``). Over 60 s (106-135 s
measured on the shared 2-core machine): 20 steps slowed to 1 s each, so that the faults
land mid-training, three restarts (the shrink's composes the launch again) and two DOWN
nodes' detection. It sets nodes DOWN, so its job is exclusive and it is in the node-down
scope (tests/conftest.py), as is tests/slurm/test_lost_batch_host.py (a lost batch host).
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
from axonn_launch.common.jobdir import JobPaths, read_record
from axonn_launch.submit.chain import DONE
from tests.conftest import run_launcher
from tests.slurm.test_faults import (
    jobs_cli,
    rank_pids,
    sacct_state,
    wait_ended,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 20
TRAIN = [
    "grid.x=2", "grid.z=2", f"train.steps={STEPS}", "train.sample_tokens=0",
    "train.checkpoint_every=2", "preflight=false", "train.gemm_tuning=false", "force=true",
]  # fmt: skip
ON_SLURM = [
    "machine=slurm_local", "nodes=2", "machine.slurm.partition=wide",
    "+machine.slurm.extra_sbatch.exclude=n1", "recovery.spare_nodes=1", "wait=false",
    "recovery.in_job_restarts=3", "recovery.on_fewer_nodes=shrink",
    "+machine.slurm.exclusive=true",  # no other test file's job is on a node set DOWN
]  # fmt: skip
SLOW = "slow@step2:1"  # every rank sleeps 1 s in each step from step 2 (the loss is unchanged)
VICTIM = "n3"  # the node set DOWN: only the wide partition holds it, so only this run
SPARE = "n4"  # then set DOWN with no spare left: the grid shrinks to n2 alone


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
def healed(slurm_cluster, local_run, tmp_path_factory) -> dict:
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
    # the uninterrupted run: test_lost_batch_host.py's 2-node grid is the same one (same
    # worker, conftest.suite_scope), run once for both (``local_run``)
    local = local_run(TRAIN)
    wait_until(lambda: metrics_step(job_dir) >= 5, 300, "step 5 (after checkpoint 4)")
    pids = wait_until(lambda: len(p := rank_pids(job_id)) == 4 and p, 60, "the 4 ranks")
    os.kill(pids[1], signal.SIGKILL)
    wait_until(lambda: len(restarts(job_dir)) == 1, 180, "the first restart in place")
    wait_until(lambda: metrics_step(job_dir) >= 9, 300, "step 9 after the restart")
    nodes_before = restarts(job_dir)[0]["nodes"]
    try:
        set_down(VICTIM)
        wait_until(lambda: len(restarts(job_dir)) == 2, 180, "the restart on the spare")
        wait_until(lambda: metrics_step(job_dir) >= 13, 300, "step 13 on the spare")
        set_down(SPARE)
        state = wait_ended(job_id, timeout_s=420)
        recovery_job = str(read_record(job_dir)["recovery_job"])
        wait_ended(recovery_job, timeout_s=300)  # afterany: it runs after a success too
    finally:
        for node in (VICTIM, SPARE):  # an error if it is back already
            back = ["scontrol", "update", f"nodename={node}", "state=resume"]
            subprocess.run(back, capture_output=True, timeout=60)
    return {"dir": job_dir, "job_id": job_id, "state": state, "shim": shim,
            "local": local, "nodes_before": nodes_before}  # fmt: skip


def set_down(node: str) -> None:
    down = ["scontrol", "update", f"nodename={node}", "state=down", "reason=test_in_place"]
    subprocess.run(down, check=True, timeout=60)


def summary(job_dir: Path) -> dict:
    return json.loads((job_dir / "summary.json").read_text())


def losses(job_dir: Path) -> dict[int, float]:
    """Each step's loss, the newest row of a step trained again after a restart."""
    lines = (job_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_three_faults_heal_inside_one_job_to_the_uninterrupted_loss(healed):
    """Up to the checkpoint the shrunk grid resumed from (trained on x2 z2, the spare's
    restart included), every loss is the uninterrupted run's exactly; the end, on the
    shrunk grid, to 1e-4 as the chain's shrink (test_recovery's lost node)."""
    assert healed["state"] == "COMPLETED", sacct_state(healed["job_id"])
    # the run's goodput is in its TensorBoard folder before anyone ran jobs status (the
    # first status call is below): its recovery job wrote it once the allocation ended
    assert JobPaths(healed["dir"]).goodput_logged.is_file()
    shrunk, reference = summary(healed["dir"]), summary(healed["local"])
    resumed = shrunk["resumed_from"]
    assert 8 <= resumed < STEPS, shrunk
    ours, theirs = losses(healed["dir"]), losses(healed["local"])
    assert [ours[s] for s in range(1, resumed + 1)] == [theirs[s] for s in range(1, resumed + 1)]
    assert shrunk["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-4)
    calls = (healed["shim"] / "calls.log").read_text().splitlines()
    assert len(calls) == 2 and "afterany" in calls[1], calls  # the job, its recovery job


def test_sacct_shows_four_training_steps_on_the_spare_then_shrunk(healed):
    command = ["sacct", "-n", "-P", "-o", "JobID,State,NodeList", "-j", healed["job_id"]]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    steps = [line.split("|") for line in out.stdout.splitlines()]
    numbered = [s for s in steps if s[0].partition(".")[2].isdigit()]  # not batch, not the job
    assert len(numbered) == 4, steps
    assert healed["nodes_before"] == ["n2", "n3"]  # the kill: the same nodes again
    on_spare = slurmtext.expand_nodelist(numbered[2][2])
    assert VICTIM not in on_spare and SPARE in on_spare, steps
    assert list(slurmtext.expand_nodelist(numbered[3][2])) == ["n2"], steps  # shrunk: n2 alone


def test_the_shrunk_step_ran_the_planners_grid_for_one_node(healed):
    """The chain's replanning for the nodes left (nodes=1 grid=auto): the grid of the
    node's two tasks, in spec.json, which the step read, and in the step's record."""
    last = restarts(healed["dir"])[-1]
    assert last["nodes"] == ["n2"] and last["shrunk_to"]["nodes"] == 1, last
    grid = last["shrunk_to"]["grid"]
    assert grid["data"] * grid["x"] * grid["y"] * grid["z"] == 2, grid
    assert last["shrunk_to"]["from"] == {"data": 1, "x": 2, "y": 1, "z": 2}, last
    spec = json.loads((healed["dir"] / "spec.json").read_text())
    assert {k: spec["grid"][k] for k in grid} == grid, spec["grid"]


def test_the_chain_records_three_attempts_in_place_by_class(healed):
    """One entry per failure: the recovery job, which ran after the job's end (afterany),
    added none; each entry is keyed by the job and its step."""
    chain_record = read_record(healed["dir"])["chain"]
    assert chain_record["state"] == DONE, chain_record
    attempts = chain_record["attempts"]
    job_id = healed["job_id"]
    assert [a["failure_key"] for a in attempts] == [f"{job_id}.{n}" for n in range(3)], attempts
    assert [(a["class"], a["action"], a["in_place"]) for a in attempts] == [
        ("rank_killed", "resume", True),
        ("node_failure", "resume_exclude", True),
        ("node_failure", "resume_exclude", True),
    ], attempts
    assert attempts[1]["bad_nodes"] == [VICTIM] and VICTIM not in attempts[1]["next_nodes"]
    assert attempts[2]["bad_nodes"] == [SPARE] and attempts[2]["next_nodes"] == ["n2"]


def test_status_shows_one_run_of_four_attempts_and_the_time_to_recover(healed):
    result = jobs_cli("status", str(healed["dir"]), "--json", cwd=healed["dir"].parent)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row["attempts"] == 4 and row["failure"] == "completed", row
    assert len(row["goodput"]["ttr_s"]) == 3 and row["goodput"]["recovery_s"] > 0, row["goodput"]
    text = jobs_cli("status", str(healed["dir"]), cwd=healed["dir"].parent).stdout
    assert "4 attempts in 1 allocation" in text, text
