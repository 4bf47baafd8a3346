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


SLURM_PREFIX = "tests/slurm"  # node ids of the Slurm tests start so


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """How pytest-xdist shares the tests among its workers (the suite runs on 2): by scope,
    where every Slurm test is one scope, run one after another on one worker (they share
    the cluster's two nodes, and some take a node down), and every other test file is a
    scope of its own, so that its module fixtures run once, on one worker. (A scheduler of
    our own, not ``--dist loadgroup``: xdist 3.8 marks a group by rewriting a test's node
    id, which pytest 9.2 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SuiteScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "slurm" if path.startswith(f"{SLURM_PREFIX}/") else path

    return SuiteScheduling(config, log)


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
