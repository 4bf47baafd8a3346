"""Each launch-time check runs once per launch: counted from inside a real dry run
(``python -m axonn_launch ... dry_run=true`` in a subprocess), with counting wrappers around
the real checks installed before the launcher is imported. A run is checked by
``cli.ValidateRun`` before Hydra makes its job dir, a sweep point by ``cli.run_checks``;
``pipeline.launch`` takes what they found and checks nothing again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

COUNTING_LAUNCH = """
import json, sys
from axonn_launch.config import resolve as resolution
from axonn_launch.submit import allocation, pack, rehearse
counts = {}
def count(owner, name):
    original = getattr(owner, name)
    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)
    setattr(owner, name, counted)
for owner, name in [
    (resolution, "resolve"), (resolution, "check_job_dir"), (resolution, "container_warnings"),
    (allocation, "check_fits"), (pack, "check"), (rehearse, "prepare"),
]:
    count(owner, name)
from axonn_launch.submit import pipeline  # after the wrappers: it imports resolve's names
count(pipeline, "require_scheduler")
from axonn_launch.cli import main  # after the wrappers: it imports the counted checks
sys.argv = ["axonn_launch", *sys.argv[1:]]
try:
    main()
finally:
    print(json.dumps(counts), file=sys.stderr)
"""
CHECKS = (
    "resolve",
    "check_job_dir",
    "container_warnings",
    "require_scheduler",
    "check_fits",
    "check",
)


def launch_counts(tmp_path: Path, *overrides: str) -> dict[str, int]:
    env = {**os.environ, "SLURM_CONF": str(tmp_path / "no-slurm.conf")}  # no cluster asked
    env.pop("SLURM_JOB_ID", None)
    result = subprocess.run(
        [sys.executable, "-c", COUNTING_LAUNCH, *overrides, "dry_run=true"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stderr.strip().splitlines()[-1])


def test_a_dry_run_runs_each_check_once(tmp_path):
    counts = launch_counts(
        tmp_path, "machine=frontier", "model=gpt_tiny", "grid.x=8", "nodes=1",
        f"hydra.run.dir={tmp_path / 'job'}",
    )  # fmt: skip
    assert (tmp_path / "job" / "job.json").is_file()
    assert counts == dict.fromkeys(CHECKS, 1)


def test_a_rehearsal_prepares_once_and_checks_its_site_config_once(tmp_path):
    counts = launch_counts(
        tmp_path, "machine=frontier", "model=gpt_tiny", "rehearse=true",
        f"hydra.run.dir={tmp_path / 'job'}",
    )  # fmt: skip
    assert json.loads((tmp_path / "job" / "job.json").read_text())["rehearsal_of"] == "frontier"
    assert counts == {**dict.fromkeys(CHECKS, 1), "prepare": 1}


def test_each_sweep_point_is_checked_once(tmp_path):
    counts = launch_counts(
        tmp_path, "-m", "machine=frontier", "model=gpt_tiny", "train.seed=1,2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )  # fmt: skip
    assert len(list((tmp_path / "sweep").glob("*/job.json"))) == 2
    assert counts == dict.fromkeys(CHECKS, 2)
