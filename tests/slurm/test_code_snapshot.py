"""A code snapshot per job (``records/provenance.py``) on the real local cluster.

The launcher runs from a copy of the package (a git checkout of its own in a temporary
folder, first on ``PYTHONPATH``), never from this checkout. Right after the submission the
copy's loss is doubled (``train/loop.py``); rank 1 is then killed in step 5 of the first
attempt, and the chain's recovery job launches a second attempt, which resumes from step 4.
Both attempts import the job's snapshot: the run ends at the loss of the same run of the
original code on ``machine=local``, and ``jobs status``, run from the edited copy, warns that
the installed code differs. One run of 8 steps on 2 ranks, shared by the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import read_record
from axonn_launch.submit.chain import DONE, STOPPED, attempts_of, run_state
from tests.conftest import REPO, run_launcher
from tests.slurm.test_faults import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TRAIN = [
    "grid.x=2", "train.steps=8", "train.checkpoint_every=2", "train.sample_tokens=0",
    "train.gemm_tuning=false", "preflight=false", "force=true",
]  # fmt: skip
ON_SLURM = ["machine=slurm_local", "nodes=1", "wait=false", "recovery.backoff_s=1",
            "recovery.in_job_restarts=0"]  # fmt: skip  # the recovery attempt: a new job
KILL = "kill@step5:rank1:attempt1"  # one step after checkpoint 4
LOSS = "loss = model(inputs, targets, normalizer=normalizer, examples=examples)"


def copy_of_the_package(root: Path) -> Path:
    """This checkout's package in a git checkout of one commit under ``root``."""
    src = root / "src"
    shutil.copytree(REPO / "axonn_launch", src / "axonn_launch",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (src / ".gitignore").write_text("__pycache__/\n")
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "the submitted code"]):
        git(src, *args)
    return src


def git(root: Path, *args: str) -> str:
    command = ["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def from_copy(src: Path, module: str, *args: str, cwd: Path, env: dict | None = None):
    """``python -m MODULE ARGS`` importing the package from ``src``."""
    full = {**os.environ, "PYTHONPATH": str(src), "PYTHONSAFEPATH": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def double_the_loss(src: Path) -> None:
    loop = src / "axonn_launch" / "train" / "loop.py"
    text = loop.read_text()
    assert text.count(LOSS) == 1, "the loss line of train/loop.py moved"
    loop.write_text(text.replace(LOSS, f"{LOSS[:-1]}) * 2.0"))


@pytest.fixture(scope="module")
def run(slurm_cluster, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("code_snapshot")
    src = copy_of_the_package(root)
    job_dir = root / "run"
    launched = from_copy(src, "axonn_launch", *TRAIN, *ON_SLURM, f"hydra.run.dir={job_dir}",
                         cwd=root, env={"AXONN_FAULT": KILL})  # fmt: skip
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    double_the_loss(src)  # the queued run must not see it
    local = run_launcher([*TRAIN, "machine=local", f"hydra.run.dir={root / 'local'}"],
                         cwd=root, timeout=600)  # fmt: skip  # the original code, never killed
    assert local.returncode == 0, local.stderr[-2000:]
    state = wait_until(lambda: (s := run_state(job_dir)) in (DONE, STOPPED) and s, 300, "the run")
    status = from_copy(src, "axonn_launch.jobs", "status", str(job_dir), cwd=root)
    return {"root": job_dir, "src": src, "state": state, "local": root / "local",
            "status": status}  # fmt: skip


def final_loss(job_dir: Path) -> float:
    return json.loads((job_dir / "summary.json").read_text())["final_loss"]


def test_the_recovery_attempt_runs_the_submitted_code_to_the_uninterrupted_loss(run):
    assert run["state"] == DONE, read_record(run["root"]).get("chain")
    first, resumed = attempts_of(run["root"])
    assert [a["class"] for a in read_record(first)["chain"]["attempts"]] == ["rank_killed"]
    assert final_loss(resumed) == final_loss(run["local"])
    for attempt in (first, resumed):  # each attempt's own snapshot holds the original line
        assert LOSS in (attempt / "code" / "axonn_launch" / "train" / "loop.py").read_text()


def test_jobs_status_warns_that_the_installed_code_differs(run):
    status = run["status"]
    assert status.returncode == 0, status.stderr
    assert "warning: code: the installed " in status.stdout, status.stdout
    assert "import the snapshot in " in status.stdout


def test_job_json_holds_the_revision_and_the_versions(run):
    first, resumed = attempts_of(run["root"])
    found = read_record(first)["provenance"]
    revision = git(run["src"], "rev-parse", "HEAD").strip()
    assert (found["revision"], found["dirty"]) == (revision, False), found
    assert found["package"] == str(run["src"] / "axonn_launch")
    versions = found["versions"]
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions["torch"] and versions["axonn_launch"] and versions["collectives"]
    assert "\ntorch==" in (first / "pip_freeze.txt").read_text()
    later = read_record(resumed)["provenance"]  # launched from the first one's snapshot
    assert later["revision"] == revision and later["inherited_from"] == str(first)
    assert later["package"] == str(first / "code" / "axonn_launch")
