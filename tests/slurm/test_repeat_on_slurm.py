"""Repeats on the local Slurm cluster: a second launch identical to a queued job is refused
in one line naming that job (``submit/duplicates.py``) and submits nothing, ``force=true``
submits it anyway with a warning; ``jobs status`` shows a ``jobs stop``ped run as stopped by
the user (action stop, not sacct's ``CANCELLED by <uid>`` and resume), and a refused
launch as refused, not running. The jobs wait for a begin time an hour away: no node runs
anything, and every job is cancelled at the end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import read_record
from tests.cli_server import run_module
from tests.conftest import REPO, run_launcher
from tests.slurm.conftest import SlurmCluster
from tests.submit.test_local_supervisor import poll

pytestmark = pytest.mark.slurm
QUEUED = ["machine=slurm_local", "wait=false", "+machine.slurm.extra_sbatch.begin=now+3600"]


def jobs(*args: str):
    return run_module("axonn_launch.jobs", list(args), cwd=REPO, timeout=120)


def slurm_ids(job_dir: Path) -> list[str]:
    record = read_record(job_dir)
    return [str(i) for i in [*record.get("job_ids", []), record.get("recovery_job")] if i]


def status_rows(root: Path) -> dict[str, dict]:
    found = json.loads(jobs("status", "--json", str(root)).stdout)
    return {Path(r["job_dir"]).name: r for r in found}


@pytest.fixture(scope="module")
def launches(slurm_cluster: SlurmCluster, tmp_path_factory) -> dict:
    """A queued job, an identical launch beside it, the same with force=true, a launch sbatch
    refuses; then ``jobs stop`` of the first. Every Slurm job is cancelled after."""
    root = tmp_path_factory.mktemp("repeat") / "jobs"
    done = {"root": root}
    try:
        for name, extra in (("first", []), ("again", []), ("forced", ["force=true"]),
                            ("refused", ["machine.slurm.partition=nope"])):  # fmt: skip
            done[name] = run_launcher([*QUEUED, *extra, f"hydra.run.dir={root / name}"], cwd=REPO)
        done["first_id"] = read_record(root / "first")["job_ids"][0]
        done["stop"] = jobs("stop", str(root / "first"))
        yield done
    finally:
        ids = [i for d in root.glob("*") if (d / "job.json").exists() for i in slurm_ids(d)]
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, check=False, timeout=60)


def test_an_identical_second_launch_is_refused_in_one_line(launches):
    first, again = launches["root"] / "first", launches["again"]
    assert launches["first"].returncode == 0, launches["first"].stderr[-2000:]
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert again.stderr.splitlines() == [
        f"error: job {launches['first_id']} (PENDING) in {first} has the same config and is"
        f" not over: nothing submitted; follow it with python -m axonn_launch.jobs status"
        f" {first}, or add force=true to launch another"
    ]
    assert not (launches["root"] / "again" / "job.json").exists()


def test_force_true_submits_it_with_a_warning(launches):
    forced, first = launches["forced"], launches["root"] / "first"
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert (
        f"warning: job {launches['first_id']} (PENDING) in {first} has the same config;"
        " launching another (force=true)" in forced.stderr.splitlines()
    )
    assert read_record(launches["root"] / "forced")["status"] == "submitted"


def test_a_stopped_run_is_stopped_by_the_user_with_action_stop(launches):
    root = launches["root"]
    assert launches["stop"].returncode == 0, launches["stop"].stderr
    rows = poll(
        lambda: (found := status_rows(root))["first"]["failure"] == "cancelled" and found,
        60,
        "sacct's CANCELLED for the stopped job",
    )
    row = rows["first"]
    assert (row["failure"], row["action"], row["run_state"]) == ("cancelled", "stop", "stopped")
    assert row["reason"] == "stopped by the user (python -m axonn_launch.jobs stop)"
    assert row["state"] == "CANCELLED (jobs stop)"
    table = jobs("status", str(root)).stdout.splitlines()
    notes = [line for line in table if line.startswith("  ")]
    words = "stopped by the user (python -m axonn_launch.jobs stop) (action: stop)"
    assert f"  {row['job_id']}: {words}" in notes
    assert not any("run stopped" in line or "resume" in line for line in notes), table


def test_a_refused_launch_is_refused_not_running(launches):
    assert launches["refused"].returncode == 1, launches["refused"].stderr[-2000:]
    row = status_rows(launches["root"])["refused"]
    assert (row["state"], row["run_state"]) == ("REFUSED", "refused")
