"""A lost batch host: the node that runs a job's batch script and its training step goes.

A 1-node x2 run with one spare on the debug partition holds n1 and n2 (exclusive: no job
of another test file is on them when n1 goes); its batch script and step run on n1. It
pauses after step 9 (checkpoint 8); n1 is set DOWN. Slurm resizes the job (RESIZING) and
ends it on n2, COMPLETED although the run has steps left, and an ``afternotok`` recovery
job would be cancelled. Its recovery job depends ``afterany`` and decides for itself: a
``node_failure`` of n1 (sacct's RESIZING rows name the node the job lost), and the next
attempt runs on n2 alone (no spare fits beside it), resumed from checkpoint 8, to the
uninterrupted run's loss. It takes n1 down, so it is in the node-down scope
(tests/conftest.py). Over 60 s: two attempts, a node's loss and the uninterrupted run.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

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
ONE_NODE = ["grid.x=2", "grid.z=1", "nodes=1"]
TRAIN = [*ONE_NODE, f"train.steps={STEPS}", "train.sample_tokens=0", "train.checkpoint_every=2",
         "preflight=false", "train.gemm_tuning=false", "force=true"]  # fmt: skip
ON_SLURM = ["machine=slurm_local", "recovery.spare_nodes=1", "wait=false",
            "recovery.backoff_s=1", "+machine.slurm.exclusive=true"]  # fmt: skip
PAUSE = {"AXONN_FAULT": "pause@step9:600:attempt1"}


@pytest.fixture(scope="module")
def lost(slurm_cluster, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("batch_host")
    job_dir = root / "run"
    launched = run_launcher([*TRAIN, *ON_SLURM, f"hydra.run.dir={job_dir}"], cwd=root,
                            env=PAUSE, timeout=300)  # fmt: skip
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    reference = root / "local"
    local = run_launcher([*TRAIN, "machine=local", f"hydra.run.dir={reference}"], cwd=root,
                         timeout=600)  # fmt: skip
    assert local.returncode == 0, local.stderr[-2000:]
    first = Job("batch_host", job_dir, read_record(job_dir)["job_ids"][0])
    wait_until(lambda: paused_at_step_9(first), 300, "the run to pause after step 9")
    assert sacct_state(first.job_id)[1] == "n[1-2]", sacct_state(first.job_id)
    try:
        down = ["scontrol", "update", f"nodename={BATCH_HOST}", "state=down",
                "reason=test_batch_host"]  # fmt: skip
        subprocess.run(down, check=True, timeout=60)
        wait_until(lambda: run_state(job_dir) in (DONE, STOPPED), 420,
                   "the run that lost its batch host to end")  # fmt: skip
        last = read_record(attempts_of(job_dir)[-1])["job_ids"][-1]
        wait_ended(str(last), timeout_s=300)  # its allocation too, not only its training
    finally:
        back = ["scontrol", "update", f"nodename={BATCH_HOST}", "state=resume"]
        subprocess.run(back, capture_output=True, timeout=60)
    return {"dir": job_dir, "reference": reference, "state": run_state(job_dir)}


def summary(job_dir: Path) -> dict:
    return json.loads((job_dir / "summary.json").read_text())


def test_a_lost_batch_host_is_a_node_failure_and_the_run_completes_without_it(lost):
    """Whatever Slurm calls the resized job's end, its recovery job (afterany) classes it a
    node_failure of n1 and the next attempt runs on n2 alone, resumed from checkpoint 8,
    to the uninterrupted run's loss; status says so, and the run is done, not running."""
    job_dir = lost["dir"]
    assert lost["state"] == DONE, read_record(job_dir).get("chain")
    (failed,) = read_record(job_dir)["chain"]["attempts"]
    assert (failed["class"], failed["action"]) == ("node_failure", "resume_exclude"), failed
    assert "lost n1" in failed["reason"], failed
    last = attempts_of(job_dir)[-1]
    record = read_record(last)
    assert record["excluded_nodes"] == [BATCH_HOST], record
    assert sacct_state(record["job_ids"][-1])[1] == "n2"
    ours, reference = summary(last), summary(lost["reference"])
    assert ours["resumed_from"] == 8 and ours["steps"] == STEPS, ours
    assert ours["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-6)
    rows = json.loads(jobs_cli("status", str(job_dir), "--json", cwd=job_dir.parent).stdout)
    assert [(r["failure"], r["run_state"]) for r in rows] == [("completed", "done")], rows
