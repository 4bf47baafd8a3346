"""Restarts in place, on the login node and in the decision's own parts.

What a launch renders and records (the batch script's loop, the spares in ``--nodes``,
``--no-kill``, job.json's ``in_job``, the summary's node-hours), the one-line errors for
bad settings, the decision by class (the chain's policy), the choice of the next step's
nodes (spares in a failed node's place, too few: the chain) and the goodput's cut of one
allocation at each restart. The restarts themselves, on the real cluster:
tests/slurm/test_restart_in_place.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from axonn_launch.batch.restart import next_nodes, stop_reason
from axonn_launch.config.compose import RecoveryConfig
from axonn_launch.records import failures
from axonn_launch.records.status import split_at_restarts
from axonn_launch.submit import chain
from tests.conftest import run_launcher

LOCAL_SLURM = ["machine=slurm_local", "grid.x=2", "grid.z=2", "nodes=2", "dry_run=true"]
SETTINGS = {"limit": 2, "nodes": 2, "spare_nodes": 1, "tasks_per_node": 2, "steps": [],
            "policy": dict(chain.DEFAULT_POLICY)}  # fmt: skip


def dry_run(args: list[str], tmp_path: Path, name: str) -> tuple[str, dict, str]:
    job = tmp_path / name
    proc = run_launcher([*args, f"hydra.run.dir='{job}'"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((job / "job.json").read_text())
    return (job / "submission.sh").read_text(), record, proc.stdout


def test_a_spare_is_asked_for_with_no_kill_and_the_first_step_runs_on_the_grid(tmp_path):
    script, record, out = dry_run([*LOCAL_SLURM, "recovery.spare_nodes=1"], tmp_path, "a job")
    assert "#SBATCH --nodes=3" in script and "#SBATCH --no-kill" in script
    assert "axonn_step=(--nodes=2 --ntasks=4)" in script
    assert 'srun "${axonn_step[@]}" --unbuffered' in script
    decide = f"-m axonn_launch.restart '{tmp_path}/a job' \"$axonn_rc\""  # quoted
    assert decide in script, script
    assert record["in_job"]["limit"] == 2 and record["in_job"]["nodes"] == 2
    assert record["in_job"]["policy"]["node_failure"] == "resume_exclude"
    assert "spares     1 node idle beside the grid's 2 (+50%" in out, out
    bash = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert bash.returncode == 0, bash.stderr


@pytest.mark.parametrize(
    "overrides", [["recovery.in_job_restarts=0"], ["recovery=off"], ["rehearse=true"]]
)
def test_no_loop_without_restarts_nor_in_a_rehearsal(tmp_path, overrides):
    args = [*LOCAL_SLURM, *overrides]
    if "rehearse=true" in overrides:  # a rehearsal runs a site's script once
        args = ["machine=perlmutter", "model=gpt_tiny", "site.accounts.perlmutter=m1_g",
                "dry_run=true", *overrides]  # fmt: skip
    script, record, out = dry_run(args, tmp_path, "job")
    assert "axonn_step" not in script and "in_job" not in record and "\nrestarts " not in out


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["recovery.spare_nodes=-1"], "recovery.spare_nodes=-1: must be 0 or more"),
        (["recovery.in_job_restarts=-2"], "recovery.in_job_restarts=-2: must be 0 or more"),
        (["machine=local", "recovery.spare_nodes=1"], "recovery.spare_nodes=1: machine=local"),
    ],
)
def test_bad_settings_are_one_line_and_nothing_is_written(tmp_path, args, line):
    proc = run_launcher(["machine=slurm_local", "dry_run=true", *args,
                         f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {line}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "job").exists()


@pytest.mark.parametrize("failure", failures.CLASSES)
def test_a_class_restarts_in_place_exactly_when_the_chain_resumes_it(tmp_path, failure):
    action = chain.policy_of(RecoveryConfig(), failure)
    why = stop_reason(tmp_path, SETTINGS, failure, action)
    resumes = action in (chain.RESUME, chain.RESUME_EXCLUDE)
    assert (why == "") == resumes, (failure, action, why)
    if not resumes:
        assert why == f"{failure}: policy {action}"


def test_restarts_used_up_stop_and_hand_over_to_the_chain(tmp_path):
    used = {**SETTINGS, "steps": [{}, {}]}
    why = stop_reason(tmp_path, used, failures.RANK_KILLED, chain.RESUME)
    assert why == "recovery.in_job_restarts=2: 2 restarts in place made"


def test_the_next_step_keeps_its_good_nodes_and_takes_a_spare_for_a_bad_one():
    ran_on, held = ("n2", "n3"), ("n2", "n4")  # n3 left the allocation (--no-kill)
    assert next_nodes(ran_on, held, ("n3",), SETTINGS) == (("n2", "n4"), "")
    assert next_nodes(ran_on, ("n2", "n3", "n4"), (), SETTINGS) == (("n2", "n3"), "")
    assert next_nodes(("n3", "n2"), ("n2", "n3", "n4"), ("n3",), SETTINGS)[0] == ("n2", "n4")
    nodes, why = next_nodes(ran_on, ("n2",), ("n3",), SETTINGS)
    assert nodes == () and why.startswith("1 of the 2 nodes the grid needs left"), why


def test_goodput_cuts_one_allocation_at_each_restart_without_queue_time():
    cut = split_at_restarts([[0.0, 10.0, 100.0]], [40.0, 70.0, 150.0])
    assert cut == [[0.0, 10.0, 40.0], [40.0, 40.0, 70.0], [70.0, 70.0, 100.0]]
    assert split_at_restarts([[0.0, 10.0, 100.0]], []) == [[0.0, 10.0, 100.0]]
