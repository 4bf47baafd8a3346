"""One launch composes its config once and resolves it once, and passes that resolution on:
counted from inside a real launch (``python -m axonn_launch ...`` in a subprocess, with
counting wrappers installed before the launcher is imported). With ``grid=auto`` the
resolution takes the planner's row as it is (no memory or step time priced again); on
Slurm, the node-local copy of the environment is worked out once per launch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

COUNTING_LAUNCH = """
import json, sys
from types import SimpleNamespace
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from axonn_launch.config import resolve as resolution
from axonn_launch.scheduler import slurm_jobs
from axonn_launch.submit import render
counts = {}
def count(owner, name, key):
    original = getattr(owner, name)
    def counted(*args, **kwargs):
        counts[key] = counts.get(key, 0) + 1
        return original(*args, **kwargs)
    setattr(owner, name, counted)
count(ConfigLoaderImpl, "load_configuration", "compose")  # every composition, Hydra's too
count(resolution, "resolve", "resolve")
count(resolution, "fit_micro_batch", "memory priced by resolve")
count(resolution, "step_time", "step time priced by resolve")
count(render, "python_copy", "python_copy")
slurm_jobs.submit = lambda **kwargs: SimpleNamespace(job_id="4242")  # sbatch's answer
from axonn_launch.cli import main  # after the wrappers: it imports the counted resolve
sys.argv = ["axonn_launch", *sys.argv[1:]]
try:
    main()
finally:
    print(json.dumps(counts), file=sys.stderr)
"""


def launch_counts(tmp_path: Path, *overrides: str) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", COUNTING_LAUNCH, *overrides, f"hydra.run.dir={tmp_path / 'job'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stderr.strip().splitlines()[-1])


def test_a_slurm_submission_composes_once_resolves_once_and_copies_python_once(tmp_path):
    counts = launch_counts(
        tmp_path, "machine=frontier", "model=gpt_5b", "grid.x=8", "nodes=1",
        "machine.python_broadcast=true", "site.accounts.frontier=abc123", "recovery=off",
    )  # fmt: skip
    assert (tmp_path / "job" / "submission.sh").is_file()
    assert json.loads((tmp_path / "job" / "job.json").read_text())["job_ids"] == ["4242"]
    assert counts == {
        "compose": 1,
        "resolve": 1,
        "memory priced by resolve": 1,
        "step time priced by resolve": 1,
        "python_copy": 1,
    }


def test_grid_auto_takes_the_planners_row_without_pricing_it_again(tmp_path):
    counts = launch_counts(tmp_path, "machine=frontier", "model=gpt_5b", "grid=auto", "nodes=1",
                           "dry_run=true")  # fmt: skip
    assert counts == {"compose": 1, "resolve": 1, "python_copy": 1}


def test_no_context_variable_carries_a_resolution():
    """The resolution is passed as an argument, never kept in a ContextVar."""
    config = REPO / "axonn_launch" / "config"
    holders = [p.name for p in config.glob("*.py") if "ContextVar" in p.read_text()]
    assert not holders, holders
