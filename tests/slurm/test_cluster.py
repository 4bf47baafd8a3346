"""The local Slurm cluster itself: multi-node steps, accounting states, and submitit on top."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import submitit

from .conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(90)]

# States after which sacct's record of a job no longer changes.
UNFINISHED = ("", "PENDING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED")


def run(*cmd: str, timeout: float = 60) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}"
    return proc.stdout


def sacct_record(job_id: str) -> dict[str, str]:
    """The allocation line of ``sacct`` for a job (empty values if it is not recorded yet)."""
    fields = ("JobID", "State", "NodeList", "ExitCode")
    out = run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", ",".join(fields))
    lines = [line for line in out.splitlines() if line.split("|")[0] == job_id]
    return dict(zip(fields, lines[-1].split("|"))) if lines else dict.fromkeys(fields, "")


def final_sacct_record(job_id: str, timeout_s: float = 30) -> dict[str, str]:
    """Polls sacct until the job's state is final (slurmdbd records it shortly after the end)."""
    deadline = time.monotonic() + timeout_s
    record = sacct_record(job_id)
    while record["State"] in UNFINISHED and time.monotonic() < deadline:
        time.sleep(0.5)
        record = sacct_record(job_id)
    return record


def sbatch(cluster: SlurmCluster, out: Path, *args: str) -> str:
    return run(
        "sbatch", "--parsable", f"--partition={cluster.partition}", f"--output={out}", *args
    ).strip()


def wait_for_squeue_state(job_id: str, state: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while run("squeue", "-h", "-j", job_id, "-o", "%T").strip() != state:
        assert time.monotonic() < deadline, f"job {job_id} not {state} after {timeout_s} s"
        time.sleep(0.5)


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
    record = final_sacct_record(job_id)
    assert record["State"] == "COMPLETED"
    assert record["NodeList"] == "n[1-2]"
    assert record["ExitCode"] == "0:0"


def test_failing_job_is_failed_in_sacct_with_its_exit_code(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    job_id = sbatch(slurm_cluster, tmp_path / "out.txt", "--wait", "--wrap=exit 3")
    record = final_sacct_record(job_id)
    assert record["State"] == "FAILED"
    assert record["ExitCode"] == "3:0"


def test_cancelled_job_is_cancelled_in_sacct(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id = sbatch(slurm_cluster, tmp_path / "out.txt", "--nodes=2", "--wrap=srun sleep 300")
    wait_for_squeue_state(job_id, "RUNNING")
    run("scancel", job_id)
    record = final_sacct_record(job_id)
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
    executor.update_parameters(
        nodes=2, tasks_per_node=1, timeout_min=2, slurm_partition=slurm_cluster.partition
    )
    with submitit.helpers.clean_env():
        job = executor.submit(rank_report, "hello")
    results = job.results()
    assert results == [("hello", 0, 0, "n1"), ("hello", 1, 1, "n2")]
    deadline = time.monotonic() + 30
    while job.state != "COMPLETED" and time.monotonic() < deadline:
        time.sleep(1)
        job.get_info(mode="force")
    assert job.state == "COMPLETED"
    assert job.get_info()["NodeList"] == "n[1-2]"
