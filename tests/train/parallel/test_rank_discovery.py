"""Rank discovery for every launcher x MPI plugin: who the rank is, whatever else is set.

Each row is the environment one launcher gives one task, with the variables as measured on
the local Slurm cluster (``srun --mpi=pmix|pmi2|cray_shasta``, ``mpirun`` inside and outside
an allocation) and as torchrun documents them. The pmix rows are what Alps's srun line
(``--mpi=pmix``) gives every task: they must not need mpi4py. tests/slurm/test_rehearsal.py
runs the rule under a real ``srun --mpi=pmix``.
"""

from __future__ import annotations

import sys

import pytest

from axonn_launch.common.spec import RuntimeConfig
from axonn_launch.train.parallel.bootstrap import SLURM_PORT_RANGE, discover_env

CPU = RuntimeConfig(device="cpu", master_port=29500)
SLURM_STEP = {  # task 5 of 8 (4 per node), on the second node of a step of job 77
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "nid[001,002]",
    "SLURM_JOB_NODELIST": "nid[001,002]",
}
PMIX = {"PMIX_RANK": "5", "PMIX_NAMESPACE": "slurm.pmix.77.0", "PMIX_SERVER_URI4": "x"}
PMI2 = {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_FD": "11", "PMI_JOBID": "77.0"}
CRAY_SHASTA = {"PALS_RANKID": "5", "PALS_NODEID": "1", "PALS_APID": "77.0", "PMI_CONTROL_PORT": "1"}
# mpirun inside an allocation: its daemons run as one Slurm step with one task per node, so
# every rank inherits the daemon's SLURM_PROCID (0 on the first node, as measured)
MPIRUN_IN_ALLOCATION = {
    **SLURM_STEP,
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0",
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "PMIX_RANK": "5",
    "MASTER_ADDR": "nid001",
}
MPIRUN = {k: v for k, v in MPIRUN_IN_ALLOCATION.items() if not k.startswith("SLURM_")}
TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "nid001",
    "MASTER_PORT": "29400",
}
# rank, local rank, world, local world, master address, source
EXPECTED = (5, 1, 8, 4, "nid001", "slurm")

TABLE = [
    ("srun, no MPI plugin", SLURM_STEP, EXPECTED),
    ("srun --mpi=pmix (Alps)", {**SLURM_STEP, **PMIX}, EXPECTED),
    ("srun --mpi=pmi2", {**SLURM_STEP, **PMI2}, EXPECTED),
    ("srun --mpi=cray_shasta (Frontier, Perlmutter)", {**SLURM_STEP, **CRAY_SHASTA}, EXPECTED),
    ("mpirun inside an allocation", MPIRUN_IN_ALLOCATION, (5, 1, 8, 4, "nid001", "mpi")),
    ("mpirun outside Slurm", MPIRUN, (5, 1, 8, 4, "nid001", "mpi")),
    ("torchrun", TORCHRUN, (5, 1, 8, 4, "nid001", "torchrun")),
    ("torchrun inside a Slurm step", {**SLURM_STEP, **PMIX, **TORCHRUN},
     (5, 1, 8, 4, "nid001", "torchrun")),
    ("nothing", {}, (0, 0, 1, 1, "127.0.0.1", "single")),
]  # fmt: skip


@pytest.mark.parametrize(("launcher", "environ", "expected"), TABLE, ids=[t[0] for t in TABLE])
def test_rank_discovery_without_mpi4py(monkeypatch, launcher, environ, expected):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as in Alps's container venv
    env = discover_env(CPU, environ)
    found = (env.rank, env.local_rank, env.world_size, env.local_world_size, env.master_addr)
    assert (*found, env.source) == expected, launcher


def test_slurm_steps_get_a_port_per_job():
    env = discover_env(CPU, {**SLURM_STEP, **PMIX})
    assert env.master_port == CPU.master_port + 77 % SLURM_PORT_RANGE


def test_mpiexec_outside_slurm_without_mpi4py_says_what_to_do(monkeypatch):
    """MPICH's mpiexec sets PMI variables only: without mpi4py nothing gives the ranks."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(RuntimeError, match="outside Slurm.*pip install mpi4py"):
        discover_env(CPU, PMI2)
