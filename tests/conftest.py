import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_sbatch(tmp_path):
    """A PATH whose sbatch/srun only record that they were called."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    marker = tmp_path / "sbatch_called"
    for tool in ("sbatch", "srun"):
        script = bindir / tool
        script.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {marker}\necho 'Submitted batch job 1'\n")
        script.chmod(0o755)
    return bindir, marker


SLURM_TESTS = REPO / "tests" / "slurm"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's ``--dist loadgroup`` (the suite runs on 2 workers): every
    Slurm test in one group, run one after another on one worker (they share the cluster's
    two nodes, and some take a node down); every other test module in a group of its own,
    so that its module fixtures run once, on one worker."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        path = Path(str(item.path))
        group = "slurm" if SLURM_TESTS in path.parents else path.relative_to(REPO).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))


def run_launcher(args, *, cwd, path_prefix=None, timeout=120, env=None):
    """Run `python -m axonn_launch ARGS` in ``cwd``; returns the CompletedProcess."""
    full_env = dict(os.environ)
    full_env.pop("HYDRA_FULL_ERROR", None)
    if path_prefix:
        full_env["PATH"] = f"{path_prefix}{os.pathsep}{full_env['PATH']}"
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "axonn_launch", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
