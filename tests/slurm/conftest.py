"""The ``slurm_cluster`` fixture: the local two-node Slurm cluster of ``machines/slurm_local``.

Tests that take the fixture are skipped, with the reason, when the cluster is not up. With
``AXONN_START_SLURM=1`` the fixture first tries to start it (root only). With
``AXONN_REQUIRE_SLURM=1`` (CI, after starting the cluster) a missing cluster fails instead.

A wedged node heals or fails at once, before every test that takes the fixture: a job stuck
COMPLETING for over ``STUCK_COMPLETING_S``, or step-launch errors in a slurmd log since that
slurmd started (``_send_slurmstepd_init failed``: slurmd can no longer start steps), restart
that node's slurmd (``node.sh restart``, root only); otherwise the test fails with the
reason instead of waiting for a job that cannot end.

Every Slurm test module holds the cluster shared (``cluster_shared``, a ``flock`` across
the suite's workers); a test that stops the cluster's daemons (``cluster_whole``) waits
until no other module uses it, and no other starts until it shares the cluster again.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from axonn_launch.common import slurmtext
from tests.conftest import run_launcher

REPO = Path(__file__).resolve().parents[2]
START_SCRIPT = REPO / "machines" / "slurm_local" / "start.sh"
NODE_SCRIPT = REPO / "machines" / "slurm_local" / "node.sh"
SLURMD_LOG = "/var/log/slurm/slurmd-{node}.log"  # lib.sh: LOG_DIR/slurmd-<node>.log
SLURMD_PIDFILE = "/run/axonn-slurm/slurmd-{node}.pid"  # lib.sh: RUN_DIR/slurmd-<node>.pid
PARTITION = "debug"
NODES = ("n1", "n2")
# start.sh's second partition: every node (4 by default), for the tests that need spares
WIDE_PARTITION = "wide"
WIDE_NODES = ("n1", "n2", "n3", "n4")
USABLE_STATES = ("idle", "mix", "alloc", "plnd")  # plnd: idle, held for a pending job
CLUSTER_LOCK = Path("/tmp/axonn-tests-slurm-cluster.lock")


@pytest.fixture(scope="module", autouse=True)
def cluster_shared() -> Iterator[object]:
    """This module uses the cluster alongside the other worker's Slurm modules."""
    with open(CLUSTER_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        yield handle


@pytest.fixture
def cluster_whole(cluster_shared) -> Iterator[Callable[[], None]]:
    """The cluster for this test alone (it stops the controller): the module's shared hold
    becomes exclusive once every other module has let go, and shared again after, or as
    soon as the test calls the function it is given (its daemons are back: the other
    worker's Slurm modules go on while the test finishes)."""
    fcntl.flock(cluster_shared, fcntl.LOCK_EX)

    def share() -> None:
        fcntl.flock(cluster_shared, fcntl.LOCK_SH)

    try:
        yield share
    finally:
        share()


STUCK_COMPLETING_S = 60  # KillWait=5: a healthy node finishes a job within seconds
SLURMD_STARTED = re.compile(r"slurmd version \S+ started")
STEPD_LAUNCH_ERRORS = re.compile(
    r"_send_slurmstepd_init failed|Unable to init slurmstepd|_forkexec_slurmstepd"
    r"|slurmstepd failed to send return code"
)


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
    """Why the cluster cannot be used now, or None if n1 and n2 (and the wide partition's
    n1-n4) are up."""
    for tool in ("sinfo", "sbatch", "srun", "sacct"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (Slurm is not installed)"
    try:
        states = {p: node_states(p) for p in (PARTITION, WIDE_PARTITION)}
    except subprocess.CalledProcessError as err:
        return f"`sinfo` failed: {err.stderr.strip() or err}"
    except subprocess.TimeoutExpired:
        return "`sinfo` did not answer within 20 s"
    for partition, nodes in ((PARTITION, NODES), (WIDE_PARTITION, WIDE_NODES)):
        found = states[partition]
        down = {n: found.get(n, "missing") for n in nodes if found.get(n) not in USABLE_STATES}
        if down:
            return f"nodes not usable in partition {partition!r}: {down}"
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


# --- wedged nodes ---------------------------------------------------------------------


def stuck_completing(
    squeue_text: str, now: datetime, limit_s: float = STUCK_COMPLETING_S
) -> dict[str, str]:
    """Node -> reason, from ``squeue -h -t COMPLETING -o '%i|%e|%N'`` (%e: when it ended)."""
    stuck: dict[str, str] = {}
    for line in squeue_text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3:
            continue
        job_id, ended, nodelist = parts
        try:
            waited = (now - datetime.fromisoformat(ended)).total_seconds()
        except ValueError:
            continue
        if waited > limit_s:
            for node in slurmtext.expand_nodelist(nodelist):
                stuck[node] = f"job {job_id} COMPLETING for {waited:.0f} s"
    return stuck


def stepd_launch_error(slurmd_log: str) -> str | None:
    """The last step-launch error this slurmd logged since it started, or None."""
    starts = list(SLURMD_STARTED.finditer(slurmd_log))
    since_start = slurmd_log[starts[-1].end() :] if starts else slurmd_log
    errors = [ln for ln in since_start.splitlines() if STEPD_LAUNCH_ERRORS.search(ln)]
    return errors[-1].strip() if errors else None


def slurmd_running(node: str) -> bool:
    """Whether the node's slurmd runs (``node.sh stop`` kills it and removes its pid file:
    a node a test took down on purpose, which no heal may bring back under that test)."""
    try:
        pid = SLURMD_PIDFILE.format(node=node)
        comm = Path(f"/proc/{int(Path(pid).read_text().strip())}/comm").read_text()
    except (OSError, ValueError):
        return False
    return comm.startswith("slurmd")


def node_problems(nodes: tuple[str, ...] = NODES) -> dict[str, str]:
    """Node -> why it is wedged, read from squeue and the slurmd logs now (a node whose
    slurmd a test stopped is not wedged: it is down, as the test wants)."""
    nodes = tuple(n for n in nodes if slurmd_running(n))
    out = subprocess.run(
        ["squeue", "-h", "-t", "COMPLETING", "-o", "%i|%e|%N"],
        capture_output=True,
        text=True,
        timeout=20,
    ).stdout
    problems = {n: r for n, r in stuck_completing(out, datetime.now()).items() if n in nodes}
    for node in nodes:
        try:
            text = Path(SLURMD_LOG.format(node=node)).read_text(errors="replace")
        except OSError:
            continue
        error = stepd_launch_error(text)
        if error and node not in problems:
            problems[node] = f"slurmd cannot launch steps: {error}"
    return problems


def heal(problems: dict[str, str]) -> str | None:
    """Restart the slurmd of each wedged node; returns why the cluster is still unusable."""
    where = "; ".join(f"{node}: {why}" for node, why in sorted(problems.items()))
    if os.geteuid() != 0:
        return f"wedged nodes ({where}); as root: bash {NODE_SCRIPT} restart NODE"
    for node in sorted(problems):
        proc = subprocess.run(
            ["bash", str(NODE_SCRIPT), "restart", node], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            return f"wedged nodes ({where}); node.sh restart {node} failed: {proc.stderr[-500:]}"
    deadline = time.monotonic() + 60
    while (left := node_problems(tuple(problems))) and time.monotonic() < deadline:
        time.sleep(2)
    return f"nodes still wedged after restarting slurmd: {left}" if left else None


def ensure_healthy() -> None:
    """Heal a wedged node now, or fail the test at once with the reason."""
    problems = node_problems()
    if problems:
        reason = heal(problems)
        if reason:
            pytest.fail(f"local Slurm cluster: {reason}", pytrace=False)


def cluster_report() -> str:
    """squeue, sinfo and wedged nodes, for a failure message."""

    def out(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{cmd[0]}: {err}"

    return (
        f"squeue:\n{out('squeue', '-o', '%i %T %M %e %N %R')}\n"
        f"sinfo:\n{out('sinfo', '-N', '-o', '%N %t %E')}\nwedged: {node_problems() or 'none'}"
    )


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.5):
    """Poll ``predicate`` until it returns something true; fail with the cluster's state."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}\n{cluster_report()}")
        time.sleep(poll_s)
    return value


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


@pytest.fixture(scope="session")
def local_run(tmp_path_factory) -> Callable[[list[str]], Path]:
    """The job dir of ``machine=local`` with these overrides, run once per session for each
    list: Slurm files on one worker (conftest.suite_scope) that compare with the same
    uninterrupted run share it (test_held_allocation.py and test_launcher_on_slurm.py;
    test_lost_batch_host.py's 2-node grid and test_restart_in_place.py; the rehearsals,
    through ``local_losses``)."""
    cache: dict[tuple[str, ...], Path] = {}

    def run(overrides: list[str]) -> Path:
        key = tuple(overrides)
        if key not in cache:
            job_dir = tmp_path_factory.mktemp("local") / "job"
            args = ["machine=local", *overrides, f"hydra.run.dir={job_dir}"]
            result = run_launcher(args, cwd=job_dir.parent, timeout=600)
            assert result.returncode == 0, result.stderr[-3000:]
            cache[key] = job_dir
        return cache[key]

    return run


@pytest.fixture(scope="session")
def local_losses(local_run) -> Callable[[str, list[str]], float]:
    """The final loss of ``machine=local`` with a model and overrides (the grid, the train
    settings), run once per session for each: the rehearsals (test_rehearsal.py,
    test_site_rehearsal.py), all on this worker (conftest.suite_scope), share one run of
    a model and grid."""

    def loss(model: str, overrides: list[str]) -> float:
        last = (local_run([f"model={model}", *overrides]) / "metrics.jsonl").read_text()
        return json.loads(last.splitlines()[-1])["loss"]

    return loss


@pytest.fixture(autouse=True)
def _no_wedged_node(request: pytest.FixtureRequest) -> None:
    """Before each test on the cluster: heal a wedged node, or fail with the reason."""
    if "slurm_cluster" in request.fixturenames:
        request.getfixturevalue("slurm_cluster")
        ensure_healthy()
