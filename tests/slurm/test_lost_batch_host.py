"""A lost batch host: the node that runs a job's batch script and its training step goes.

Two runs at once, each on exclusive nodes (no job of another test file is on a node when
it goes), both paused after step 9 (checkpoint 8); then both batch hosts are set DOWN:

- a 1-node x2 run with one spare on the debug partition holds n1 and n2; its batch script
  and step run on n1. Slurm resizes the job (RESIZING) and ends it on n2, COMPLETED (or
  FAILED) although the run has steps left, and an ``afternotok`` recovery job would be
  cancelled.
  Its recovery job depends ``afterany`` and decides for itself: a ``node_failure`` of n1
  (sacct's RESIZING rows name the node the job lost), and the next attempt runs on n2
  alone (no spare fits beside it), resumed from checkpoint 8, to the uninterrupted run's
  loss;
- a 2-node x2 z2 grid on the wide partition, on n3 and n4 (n1 and n2 excluded: the first
  run's); n3, its first node, runs the batch script. Slurm ends the job NODE_FAIL; the
  chain classes it a ``node_failure`` of n3 and the next attempt leaves n3 out, resumed
  from checkpoint 8 on the nodes free then (one node with a replanned grid while the
  other run holds n2, or two), to the uninterrupted grid's loss.

``jobs status`` of both runs is sampled from the pause to the end: every sample is right
(never stopped, never done or completed before the last step). It takes n1 and n3 down,
so it is in the node-down scope (tests/conftest.py). Over 60 s (48-92 s alone on the
shared machine, 30 s for the 1-node run alone): two attempts of each run, the nodes' loss
and the two uninterrupted runs (local, while the Slurm runs start).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from axonn_launch.common import slurmtext
from axonn_launch.common.jobdir import read_record
from axonn_launch.submit.chain import DONE, STOPPED, attempts_of, run_state
from tests.conftest import run_launcher
from tests.slurm.test_faults import (
    Job,
    jobs_cli,
    paused_at_step_9,
    sacct_state,
    wait_ended,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 20
BATCH_HOST = "n1"  # the debug partition's first node: the batch host of a job on n1-n2
GRID_HOST = "n3"  # the first node of the 2-node grid on n3-n4 (wide partition)
ONE_NODE = ["grid.x=2", "grid.z=1", "nodes=1"]
TWO_NODES = ["grid.x=2", "grid.z=2", "nodes=2"]
TRAIN = [f"train.steps={STEPS}", "train.sample_tokens=0", "train.checkpoint_every=2",
         "preflight=false", "train.gemm_tuning=false", "force=true"]  # fmt: skip
ON_SLURM = ["machine=slurm_local", "wait=false", "recovery.backoff_s=1",
            "+machine.slurm.exclusive=true"]  # fmt: skip
RUNS = {  # name: (grid, Slurm overrides, the node set DOWN, how the chain names the loss)
    # sacct's RESIZING rows name the node the job lost
    "spare": (ONE_NODE, ["recovery.spare_nodes=1"], BATCH_HOST, f"lost {BATCH_HOST}"),
    # the job is NODE_FAIL: the node is the job's own node Slurm set DOWN
    "grid": (TWO_NODES, ["machine.slurm.partition=wide",
                         "+machine.slurm.extra_sbatch.exclude='n1,n2'"], GRID_HOST, "NODE_FAIL"),
}  # fmt: skip
PAUSE = {"AXONN_FAULT": "pause@step9:600:attempt1"}
SAMPLE_S = 3  # between two samples of jobs status


def launch(root: Path, name: str) -> Job:
    grid, slurm, _, _ = RUNS[name]
    job_dir = root / name
    launched = run_launcher([*grid, *TRAIN, *ON_SLURM, *slurm, f"hydra.run.dir={job_dir}"],
                            cwd=root, env=PAUSE, timeout=300)  # fmt: skip
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    return Job(name, job_dir, read_record(job_dir)["job_ids"][0])


def reference(local_run, name: str) -> Path:
    """The same run uninterrupted, on the local machine (one node, the same grid): the 2-node
    grid's is test_restart_in_place.py's uninterrupted run too, run once for both."""
    grid = [o for o in RUNS[name][0] if not o.startswith("nodes=")]
    return local_run([*grid, *TRAIN])


def status_rows(jobs: dict[str, Job]) -> dict[str, dict]:
    """``jobs status --json`` of every run now: run name -> its row (the newest attempt)."""
    dirs = [str(job.job_dir) for job in jobs.values()]
    shown = jobs_cli("status", "--json", *dirs, cwd=next(iter(jobs.values())).job_dir.parent)
    assert shown.returncode == 0, shown.stderr
    by_root = {Path(r["run_dir"] or r["job_dir"]).name: r for r in json.loads(shown.stdout)}
    return {name: by_root[name] for name in jobs}


def follow_to_the_end(jobs: dict[str, Job], timeout_s: float) -> list[dict[str, dict]]:
    """Samples of ``jobs status`` every few seconds until every run has ended."""
    samples, deadline = [], time.monotonic() + timeout_s
    while True:
        samples.append(status_rows(jobs))
        if all(run_state(job.job_dir) in (DONE, STOPPED) for job in jobs.values()):
            return samples
        assert time.monotonic() < deadline, f"runs not ended within {timeout_s} s: {samples[-1]}"
        time.sleep(SAMPLE_S)


@pytest.fixture(scope="module")
def lost(slurm_cluster, local_run, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("batch_host")
    jobs = {name: launch(root, name) for name in RUNS}
    references = {name: reference(local_run, name) for name in RUNS}
    for job in jobs.values():
        wait_until(lambda job=job: paused_at_step_9(job), 300, f"{job.name} to pause at step 9")
    nodes = {name: sacct_state(job.job_id)[1] for name, job in jobs.items()}
    paused = status_rows(jobs)
    downed = []
    try:
        for _, _, node, _ in RUNS.values():
            down = ["scontrol", "update", f"nodename={node}", "state=down",
                    "reason=test_batch_host"]  # fmt: skip
            subprocess.run(down, check=True, timeout=60)
            downed.append(node)
        samples = follow_to_the_end(jobs, 420)
        for job in jobs.values():  # their allocations too, not only their training
            last = read_record(attempts_of(job.job_dir)[-1])["job_ids"][-1]
            wait_ended(str(last), timeout_s=300)
        samples.append(status_rows(jobs))  # the end: every allocation ended
    finally:
        for node in downed:
            back = ["scontrol", "update", f"nodename={node}", "state=resume"]
            subprocess.run(back, capture_output=True, timeout=60)
    states = {name: run_state(job.job_dir) for name, job in jobs.items()}
    return {"jobs": jobs, "references": references, "nodes": nodes, "paused": paused,
            "samples": samples, "states": states}  # fmt: skip


def summary(job_dir: Path) -> dict:
    return json.loads((job_dir / "summary.json").read_text())


@pytest.mark.parametrize("name", list(RUNS))
def test_a_lost_batch_host_is_a_node_failure_and_the_run_completes_without_it(lost, name):
    """Whatever Slurm calls the job's end, its recovery job (afterany) classes it a
    node_failure of the lost batch host, and the next attempt runs without it, resumed
    from checkpoint 8, to the uninterrupted run's loss; status says so, and the run is
    done, not running. The spare run's next attempt is on n2 alone; the grid's on the
    nodes the recovery job finds free then (n1 is down and n2 may hold the other run: one
    node with a replanned grid, or two)."""
    job_dir, (_, _, lost_node, named) = lost["jobs"][name].job_dir, RUNS[name]
    assert lost["nodes"] == {"spare": "n[1-2]", "grid": "n[3-4]"}
    assert lost["states"][name] == DONE, read_record(job_dir).get("chain")
    (failed,) = read_record(job_dir)["chain"]["attempts"]
    assert (failed["class"], failed["action"]) == ("node_failure", "resume_exclude"), failed
    assert named in failed["reason"], failed
    last = attempts_of(job_dir)[-1]
    record = read_record(last)
    assert record["excluded_nodes"] == [lost_node], record
    ran_on = list(slurmtext.expand_nodelist(sacct_state(record["job_ids"][-1])[1]))
    assert lost_node not in ran_on and len(ran_on) == record["nodes"], (ran_on, record)
    assert name == "grid" or ran_on == ["n2"], ran_on
    ours, reference = summary(last), summary(lost["references"][name])
    assert ours["resumed_from"] == 8 and ours["steps"] == STEPS, ours
    # the same grid trains the same losses; a replanned one (the grid on fewer nodes, as
    # test_recovery's lost node) agrees to 1e-4
    replanned = record["grid"] != read_record(job_dir)["grid"]
    rel = 1e-4 if replanned else 1e-6
    assert ours["final_loss"] == pytest.approx(reference["final_loss"], rel=rel), record
    rows = json.loads(jobs_cli("status", str(job_dir), "--json", cwd=job_dir.parent).stdout)
    assert [(r["failure"], r["run_state"]) for r in rows] == [("completed", "done")], rows


@pytest.mark.parametrize("name", list(RUNS))
def test_jobs_status_is_right_at_every_sample_from_the_pause_to_the_end(lost, name):
    """Paused after step 9: running, at step 8 or 9 (what the ranks' records show then).
    After the node's loss: never stopped, never done or completed before the last step;
    once every allocation ended, done and completed (the training may be done a moment
    before its job ends: done while the job is still running is right)."""
    paused = lost["paused"][name]
    assert (paused["state"], paused["run_state"]) == ("RUNNING", "running"), paused
    assert paused["step"] in (8, 9), paused
    rows = [sample[name] for sample in lost["samples"]]
    assert len(rows) >= 3, rows  # the loss, the recovery and the end were all sampled
    for row in rows:
        assert row["run_state"] in ("running", "waiting", "recovering", "done"), row
        finished = row["step"] == STEPS
        assert finished or row["run_state"] != "done", row
        assert finished or row["failure"] != "completed", row
    assert (rows[-1]["failure"], rows[-1]["run_state"]) == ("completed", "done"), rows[-1]
