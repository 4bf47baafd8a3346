"""The local Slurm cluster itself: multi-node steps, accounting states, and submitit on top."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import submitit

from axonn_launch.scheduler import slurm_jobs
from tests.conftest import run_launcher

from .conftest import (
    REPO,
    SLURMD_LOG,
    SlurmCluster,
    cluster_report,
    node_problems,
    stepd_launch_error,
    stuck_completing,
    wait_for,
)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(90)]


def run(*cmd: str, timeout: float = 60, ok_codes: tuple[int, ...] = (0,)) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd)} did not end within {timeout} s\n{cluster_report()}")
    assert proc.returncode in ok_codes, f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}"
    return proc.stdout


def sacct_record(job_id: str) -> dict[str, str]:
    """The allocation line of ``sacct`` for a job (empty values if it is not recorded yet)."""
    fields = ("JobID", "State", "NodeList", "ExitCode")
    out = run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", ",".join(fields))
    lines = [line for line in out.splitlines() if line.split("|")[0] == job_id]
    return dict(zip(fields, lines[-1].split("|"))) if lines else dict.fromkeys(fields, "")


def sacct_until(
    job_id: str, done: Callable[[dict[str, str]], bool], timeout_s: float = 30
) -> dict[str, str]:
    """Polls sacct until ``done(record)``; returns the last record read.

    slurmdbd fills a finished job's record in steps: read right after the end, a two-node
    job can briefly show only its batch host in NodeList.
    """
    records = [sacct_record(job_id)]

    def read() -> bool:
        records.append(sacct_record(job_id))
        return done(records[-1])

    if not done(records[0]):
        wait_for(read, timeout_s, f"sacct to record job {job_id} (last: {records[-1]})", 0.25)
    return records[-1]


def sbatch(cluster: SlurmCluster, out: Path, *args: str, ok_codes: tuple[int, ...] = (0,)) -> str:
    """Submits a job; returns its id. With --wait, sbatch exits with the job's exit code."""
    cmd = ("sbatch", "--parsable", f"--partition={cluster.partition}", f"--output={out}", *args)
    return run(*cmd, ok_codes=ok_codes).strip()


def wait_for_squeue_state(job_id: str, state: str, timeout_s: float = 60) -> None:
    """Within the tests' 90 s: a job may wait for CPUs that ``early_runs`` and the other
    test files' jobs hold."""

    def reached() -> bool:
        return run("squeue", "-h", "-j", job_id, "-o", "%T").strip() == state

    wait_for(reached, timeout_s, f"job {job_id} to be {state}")


def start_calibrate(cluster: SlurmCluster, folder: Path) -> subprocess.Popen:
    """``calibrate`` as users run it on a cluster: one task per "GPU" under srun, ranks and
    the master address from Slurm, groups inside a node and across the two nodes."""
    cmd = [
        "srun", f"--partition={cluster.partition}", "--nodes=2", "--ntasks-per-node=2",
        "--time=2", sys.executable, "-m", "axonn_launch.calibrate", "machine=slurm_local",
        f"output={folder / 'cal.json'}", "reps=2", "warmup=1", f"large_bytes={1 << 20}",
        "block_seconds=0.01",
    ]  # fmt: skip
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO)


@pytest.fixture(scope="module", autouse=True)
def early_runs(slurm_cluster: SlurmCluster, tmp_path_factory):
    """The module's two long runs, started before its first test: the calibration's srun
    and a 4-rank training job (wait=false). They run while the short tests do (the most
    tasks at once, 2+2+2+1 on a node, fit in its 8 CPUs); their own tests check them.
    Whatever still runs at the end of the module is stopped."""
    calibration = tmp_path_factory.mktemp("calibrate")
    job_dir = tmp_path_factory.mktemp("reattach") / "job"
    runs = {"calibrate": start_calibrate(slurm_cluster, calibration), "calibration": calibration}
    args = ["machine=slurm_local", "grid.x=2", "grid.z=2", "train.steps=2", "wait=false"]
    runs["reattach"] = run_launcher([*args, f"hydra.run.dir={job_dir}"], cwd=job_dir.parent)
    runs["job_dir"] = job_dir
    yield runs
    runs["calibrate"].kill()
    runs["calibrate"].wait()
    record = json.loads(path.read_text()) if (path := job_dir / "job.json").exists() else {}
    if job_ids := record.get("job_ids", []):
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=30)


def test_node_names_resolve_to_this_host(slurm_cluster: SlurmCluster) -> None:
    for node in slurm_cluster.nodes:
        assert socket.gethostbyname(node).startswith("127.")


def test_two_node_job_runs_two_tasks_on_each_node(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    out = tmp_path / "out.txt"
    step = "echo task $SLURM_PROCID node $SLURM_NODEID on $SLURMD_NODENAME"
    job_id = sbatch(
        slurm_cluster, out, "--wait", "--nodes=2", "--ntasks-per-node=2",
        "--time=1", f"--wrap=srun bash -c '{step}'",
    )  # fmt: skip
    lines = sorted(out.read_text().split("\n")[:-1])
    tasks = {tuple(line.split()[1::2]) for line in lines}
    assert len(lines) == 4
    assert tasks == {("0", "0", "n1"), ("1", "0", "n1"), ("2", "1", "n2"), ("3", "1", "n2")}
    record = sacct_until(job_id, lambda r: r["State"] == "COMPLETED" and r["NodeList"] == "n[1-2]")
    assert (record["State"], record["NodeList"], record["ExitCode"]) == (
        "COMPLETED",
        "n[1-2]",
        "0:0",
    )


def test_failing_job_is_failed_in_sacct_with_its_exit_code(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    job_id = sbatch(slurm_cluster, tmp_path / "out.txt", "--wait", "--wrap=exit 3", ok_codes=(3,))
    record = sacct_until(job_id, lambda r: r["State"] == "FAILED")
    assert (record["State"], record["ExitCode"]) == ("FAILED", "3:0")


def test_cancelled_job_is_cancelled_in_sacct(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id = sbatch(slurm_cluster, tmp_path / "out.txt", "--nodes=2", "--wrap=srun sleep 300")
    wait_for_squeue_state(job_id, "RUNNING")
    run("scancel", job_id)
    record = sacct_until(
        job_id, lambda r: r["State"].startswith("CANCELLED") and r["NodeList"] == "n[1-2]"
    )
    assert record["State"].startswith("CANCELLED")
    assert record["NodeList"] == "n[1-2]"


def test_submitit_two_node_job_returns_every_rank_and_completes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    def rank_report(tag: str) -> tuple[str, int, int, str]:
        env = submitit.JobEnvironment()
        return tag, env.global_rank, env.node, os.environ["SLURMD_NODENAME"]

    executor = submitit.AutoExecutor(folder=tmp_path / "%j")
    assert executor.cluster == "slurm"
    # 5 minutes: submitit asks for USR2 90 s before the limit, and Slurm may send it up to a
    # minute earlier still; with 2 minutes a task still starting after 30 s (loaded cores)
    # got USR2 and died before it returned
    executor.update_parameters(
        nodes=2, tasks_per_node=1, timeout_min=5, slurm_partition=slurm_cluster.partition
    )
    with submitit.helpers.clean_env():
        job = executor.submit(rank_report, "hello")
    results = job.results()
    assert results == [("hello", 0, 0, "n1"), ("hello", 1, 1, "n2")]
    # job.state is the sacct state; the step lines make its NodeList a step's, so not checked.
    wait_for(
        lambda: job.get_info(mode="force").get("State") == "COMPLETED",
        30,
        f"sacct to say job {job.job_id} COMPLETED",
    )
    assert job.state == "COMPLETED"


MPI_PROGRAM = """
import json
import os
from mpi4py import MPI
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank() + 1)
print(comm.Get_rank(), comm.Get_size(), total, os.environ["SLURMD_NODENAME"], flush=True)
"""


def test_srun_pmix_starts_an_mpi4py_job_across_both_nodes(slurm_cluster: SlurmCluster) -> None:
    pytest.importorskip("mpi4py")
    # n1 and n2 share a host: Open MPI's shared-memory transport would mix up their segments.
    env = {**os.environ, "OMPI_MCA_btl": "self,tcp"}
    cmd = [
        "srun", "--mpi=pmix", f"--partition={slurm_cluster.partition}", "--nodes=2",
        "--ntasks-per-node=2", "--time=1", sys.executable, "-c", MPI_PROGRAM,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = sorted(tuple(line.split()) for line in proc.stdout.splitlines())
    assert rows == [
        ("0", "4", "10", "n1"), ("1", "4", "10", "n1"),
        ("2", "4", "10", "n2"), ("3", "4", "10", "n2"),
    ]  # fmt: skip


def test_calibrate_inside_a_two_node_allocation_feeds_the_planner(
    slurm_cluster: SlurmCluster, early_runs
) -> None:
    """The calibration ``early_runs`` started (``start_calibrate``) feeds the planner."""
    folder = early_runs["calibration"]
    out = folder / "cal.json"
    try:
        returncode = early_runs["calibrate"].wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"calibrate under srun did not end within 120 s\n{cluster_report()}")
    assert returncode == 0, (folder / "stderr").read_text()[-3000:]
    raw = json.loads(out.read_text())
    assert (raw["world_size"], raw["gpus_per_node"], raw["backend"]) == (4, 2, "gloo")
    layouts = {(c["size"], c["per_node"]) for c in raw["collectives"]}
    assert layouts == {(2, 2), (2, 1), (4, 2)}  # inside a node, across nodes, the world
    assert 0.0 <= raw["overlap"]["efficiency"] <= 1.0 and raw["overlap"]["size"] == 4
    plan = subprocess.run(
        [sys.executable, "-m", "axonn_launch.plan", "machine=slurm_local", "model=gpt_tiny",
         "nodes=2", "top=3", "output=json", f"calibration={out}"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    payload = json.loads(plan.stdout)
    assert payload["calibration"] == str(out) and len(payload["plans"]) == 3


@pytest.mark.timeout(400)  # four torch ranks on a shared, loaded machine
def test_submitit_reattaches_from_job_json_alone_with_every_task(
    slurm_cluster: SlurmCluster, early_runs
) -> None:
    """A 2-node x 2-task launch (``early_runs``); then a new SlurmJob from job.json only (no
    guessing tasks=)."""
    job_dir, result = early_runs["job_dir"], early_runs["reattach"]
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((job_dir / "job.json").read_text())
    assert record["submitit"] == {"folder": str(job_dir / "slurm" / "%j"), "tasks": 4}
    job = submitit.SlurmJob(
        folder=record["submitit"]["folder"],
        job_id=record["job_ids"][-1],
        tasks=range(record["submitit"]["tasks"]),
    )
    try:
        assert job.num_tasks == 4 and len(job._sub_jobs) == 4
        streamed = io.StringIO()
        state = slurm_jobs.follow(job, out=streamed)
        assert state == "COMPLETED", (job.stderr() or "")[-2000:]
        # rank 0's log carries the startup record of the whole job
        assert "startup: 4 ranks on" in streamed.getvalue()
        assert "network: gloo, no network plugin" in streamed.getvalue()
        summaries = job.results()
        assert len(summaries) == 4  # one result per task, read from job.json's folder
        assert {s["steps"] for s in summaries} == {2}
    finally:
        subprocess.run(["scancel", job.job_id], capture_output=True, timeout=30)


def test_wedge_detection_reads_real_squeue_output(slurm_cluster: SlurmCluster, tmp_path) -> None:
    """squeue's %e is a running job's end time; parsed as the end of a COMPLETING job."""
    job_id = sbatch(slurm_cluster, tmp_path / "out.txt", "--nodes=2", "--time=1", "--wrap=sleep 60")
    try:
        wait_for_squeue_state(job_id, "RUNNING")
        line = run("squeue", "-h", "-j", job_id, "-o", "%i|%e|%N").strip()
        ended = datetime.fromisoformat(line.split("|")[1])
        assert stuck_completing(line, ended + timedelta(seconds=30)) == {}
        late = stuck_completing(line, ended + timedelta(seconds=61))
        assert late == {node: f"job {job_id} COMPLETING for 61 s" for node in ("n1", "n2")}
    finally:
        run("scancel", job_id)


def test_wedge_detection_reads_the_real_slurmd_logs(slurm_cluster: SlurmCluster) -> None:
    assert node_problems() == {}  # the fixture healed or failed before this test
    for node in slurm_cluster.nodes:
        text = Path(SLURMD_LOG.format(node=node)).read_text()
        assert "slurmd version" in text and stepd_launch_error(text) is None
        error = "[2026-01-01T00:00:00.000] error: _send_slurmstepd_init failed"
        assert stepd_launch_error(f"{text}{error}\n") == error
        restarted = "[2026-01-01T00:00:05.000] slurmd version 22.05.8 started"
        assert stepd_launch_error(f"{text}{error}\n{restarted}\n") is None
