import os
from pathlib import Path

import pytest

from tests import fake_slurm
from tests.cli_server import run_module

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_sbatch(tmp_path):
    """A PATH whose sbatch/srun only record that they were called."""
    marker = tmp_path / "sbatch_called"
    tools = {"sbatch": fake_slurm.SUBMITTED, "srun": fake_slurm.SUBMITTED}
    return fake_slurm.fake_tools(tmp_path / "fakebin", tools, calls=marker), marker


SLURM_PREFIX = "tests/slurm"  # node ids of the Slurm tests start so
# Slurm test files that take a node down, and the files that share their worker
SLURM_NODE_DOWN = {
    # takes no node down: here to even the two Slurm workers' time (each file's jobs run
    # one after another with the node-down tests', whose jobs are exclusive)
    "tests/slurm/test_code_snapshot.py",
    "tests/slurm/test_faults.py",
    "tests/slurm/test_recovery.py",
    "tests/slurm/test_requeue_old_pickle.py",
    "tests/slurm/test_lost_batch_host.py",
    "tests/slurm/test_restart_in_place.py",  # sets n3 and n4 DOWN
    "tests/slurm/test_slurm_down.py",  # stops the controller: after the others, alone
}


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown when xdist is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """How pytest-xdist shares the tests among its workers (the suite runs on 3): by scope.
    The Slurm tests that take a node down (``SLURM_NODE_DOWN``) are one scope, run one
    after another on one worker; the other Slurm tests are a second scope, on another
    worker at the same time (the jobs a node-down test takes down are exclusive, so no
    other job is on that node; ``tests/slurm/conftest.py`` leaves a stopped node alone);
    every other test file is a scope of its own, so that its module fixtures run once, on
    one worker. Those two Slurm scopes come first in the collection, so two workers start
    with one each and the third with the other files. (A scheduler of our own, not
    ``--dist loadgroup``: xdist 3.8 marks a group by rewriting a test's node id, which
    pytest 9.2 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SuiteScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return suite_scope(nodeid.split("::", 1)[0])

    return SuiteScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Slurm tests first (in their own order), then the rest as collected: the folders
    named like the package sort before ``slurm/``, and the two Slurm scopes must start first
    (``pytest_xdist_make_scheduler``)."""
    items.sort(key=lambda item: not item.nodeid.startswith(f"{SLURM_PREFIX}/"))


def suite_scope(path: str) -> str:
    """The xdist scope of a test file: ``slurm-node-down``, ``slurm``, or the file itself."""
    if path in SLURM_NODE_DOWN:
        return "slurm-node-down"
    return "slurm" if path.startswith(f"{SLURM_PREFIX}/") else path


def run_launcher(args, *, cwd, path_prefix=None, timeout=120, env=None):
    """Run `python -m axonn_launch ARGS` in ``cwd``; returns the CompletedProcess (forked
    from a process that imported the launcher already: ``tests/cli_server.py``)."""
    full_env = dict(os.environ)
    full_env.pop("HYDRA_FULL_ERROR", None)
    if path_prefix:
        full_env["PATH"] = f"{path_prefix}{os.pathsep}{full_env['PATH']}"
    full_env.update(env or {})
    return run_module("axonn_launch", list(args), cwd=cwd, env=full_env, timeout=timeout)
