"""The ``slurm_cluster`` fixture: the local two-node Slurm cluster of ``machines/slurm_local``.

Tests that take the fixture are skipped, with the reason, when the cluster is not up. With
``AXONN_START_SLURM=1`` the fixture first tries to start it (root only). With
``AXONN_REQUIRE_SLURM=1`` (CI, after starting the cluster) a missing cluster fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
START_SCRIPT = REPO / "machines" / "slurm_local" / "start.sh"
PARTITION = "debug"
NODES = ("n1", "n2")
USABLE_STATES = ("idle", "mix", "alloc", "plnd")  # plnd: idle, held for a pending job


@dataclass(frozen=True)
class SlurmCluster:
    partition: str
    nodes: tuple[str, ...]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slurm: needs the local Slurm cluster (machines/slurm_local/start.sh)"
    )


def node_states(partition: str = PARTITION) -> dict[str, str]:
    """Node name -> compact sinfo state (``idle``, ``mix``, ``down*``...) of one partition."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-p", partition, "-o", "%N %t"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    ).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def cluster_problem() -> str | None:
    """Why the cluster cannot be used now, or None if n1 and n2 are up."""
    for tool in ("sinfo", "sbatch", "srun", "sacct"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (Slurm is not installed)"
    try:
        states = node_states()
    except subprocess.CalledProcessError as err:
        return f"`sinfo` failed: {err.stderr.strip() or err}"
    except subprocess.TimeoutExpired:
        return "`sinfo` did not answer within 20 s"
    down = {n: states.get(n, "missing") for n in NODES if states.get(n) not in USABLE_STATES}
    if down:
        return f"nodes not usable in partition {PARTITION!r}: {down}"
    return None


def start_cluster() -> str | None:
    """Runs start.sh; returns why it failed, or None."""
    if os.geteuid() != 0:
        return f"AXONN_START_SLURM=1 but {START_SCRIPT} needs root"
    try:
        proc = subprocess.run(
            ["bash", str(START_SCRIPT)], capture_output=True, text=True, timeout=900
        )
    except subprocess.TimeoutExpired:
        return f"{START_SCRIPT} did not finish within 900 s"
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        return f"{START_SCRIPT} exited {proc.returncode}:\n{tail}"
    return cluster_problem()


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    problem = cluster_problem()
    if problem and os.environ.get("AXONN_START_SLURM") == "1":
        problem = start_cluster()
    if problem:
        reason = f"local Slurm cluster unavailable: {problem}"
        if os.environ.get("AXONN_REQUIRE_SLURM") == "1":
            pytest.fail(reason + " (AXONN_REQUIRE_SLURM=1)")
        pytest.skip(reason + " (run machines/slurm_local/start.sh or set AXONN_START_SLURM=1)")
    return SlurmCluster(partition=PARTITION, nodes=NODES)
