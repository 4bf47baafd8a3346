"""Rank discovery from torchrun, Slurm and MPI environments, and a real gloo rendezvous."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from axonn_launch.common.spec import RuntimeConfig
from axonn_launch.train.parallel.bootstrap import (
    SLURM_PORT_RANGE,
    choose_backend,
    choose_device,
    discover_env,
)

REPO = Path(__file__).resolve().parents[3]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CPU = RuntimeConfig(device="cpu")


def test_slurm_variables():
    environ = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_ID": "123457",
        "SLURM_JOB_NODELIST": "nid[001234-001235]",
    }
    env = discover_env(RuntimeConfig(device="cpu", master_port=29500), environ)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "nid001234"
    assert env.master_port == 29500 + 123457 % SLURM_PORT_RANGE
    assert env.source == "slurm" and env.backend == "gloo" and env.device == "cpu"


def test_slurm_step_nodelist_wins_and_uneven_tasks_per_node():
    environ = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "7",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "4,3",
        "SLURM_JOB_NODELIST": "a1,b[3,5-6]",
        "SLURM_STEP_NODELIST": "b[5-6]",
    }
    env = discover_env(CPU, environ)
    assert env.master_addr == "b5"
    assert env.local_world_size == 3


def test_torchrun_variables_take_precedence_over_slurm():
    environ = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "node7",
        "MASTER_PORT": "31000",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    env = discover_env(CPU, environ)
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert (env.master_addr, env.master_port, env.source) == ("node7", 31000, "torchrun")


def test_openmpi_variables_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails as if not installed
    environ = {
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "head",
    }
    env = discover_env(CPU, environ)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.source) == ("head", "mpi")


def test_no_launcher_means_a_single_process():
    env = discover_env(CPU, {})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")


def test_device_binding_and_backend():
    assert choose_device(RuntimeConfig(device="cuda"), 3) == "cuda:3"
    assert choose_device(RuntimeConfig(device="cuda", device_index="zero"), 3) == "cuda:0"
    assert choose_device(RuntimeConfig(device="cpu"), 3) == "cpu"
    assert choose_backend(RuntimeConfig(), "cpu") == "gloo"
    assert choose_backend(RuntimeConfig(backend="nccl"), "cuda:0") == "nccl"
    with pytest.raises(ValueError):
        choose_device(RuntimeConfig(device="cuda", device_index="closest"), 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI", "PMIX_"))
    }
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def run_workers(environments: list[dict[str, str]], port: int) -> list[dict]:
    command = [sys.executable, "-m", "tests.train.bootstrap_worker", str(port)]
    procs = [
        subprocess.Popen(command, env=e, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for e in environments
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return results


def test_torchrun_variables_rendezvous_with_gloo():
    port = free_port()
    envs = [
        clean_environment(
            RANK=str(r),
            WORLD_SIZE="2",
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        for r in range(2)
    ]
    results = run_workers(envs, port)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 3.0 and r["source"] == "torchrun" for r in results)


def test_slurm_variables_rendezvous_with_gloo():
    port = free_port()
    envs = [
        clean_environment(
            SLURM_PROCID=str(r),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(r),
            SLURM_JOB_ID="0",
            SLURM_JOB_NODELIST="localhost,otherhost",
            SLURM_TASKS_PER_NODE="2",
        )
        for r in range(2)
    ]
    results = run_workers(envs, port)
    assert all(r["sum"] == 3.0 and r["source"] == "slurm" for r in results)
    assert all(r["master_addr"] == "localhost" and r["local_world_size"] == 2 for r in results)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_mpirun_with_mpi4py_rendezvous_with_gloo(tmp_path):
    pytest.importorskip("mpi4py")
    command = [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        sys.executable,
        "-m",
        "tests.train.bootstrap_worker",
        str(free_port()),
        str(tmp_path),
    ]
    proc = subprocess.run(
        command, env=clean_environment(), cwd=REPO, capture_output=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr.decode()
    lines = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in lines) == [0, 1]
    assert all(r["sum"] == 3.0 and r["source"] == "mpi" for r in lines)
    assert sorted(r["local_rank"] for r in lines) == [0, 1]
    assert all(r["master_addr"] == socket.gethostname() for r in lines)
