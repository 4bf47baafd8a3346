"""One order for reading the rank from the environment (``common/ranks.py``), shared by the
rendezvous, the fault hooks and the Slurm task's per-rank variables: each row sets the
variables of two launchers at once, with different ranks, so that only the documented
order gives the expected one."""

from __future__ import annotations

import sys

import pytest

from axonn_launch.common.ranks import EnvRank, environment_rank
from axonn_launch.common.spec import RuntimeConfig

STEP = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}
BATCH = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}  # Python run by the batch script
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "3"}  # fmt: skip
MPICH = {"PMI_RANK": "7", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
TABLE = [
    ("torchrun before mpirun and srun", {**STEP, **OPENMPI, **TORCHRUN}, ("torchrun", 5, 1)),
    ("RANK without WORLD_SIZE is no torchrun", {**STEP, "RANK": "5"}, ("slurm_step", 2, 0)),
    ("mpirun inside an srun step of its daemons", {**STEP, **OPENMPI}, ("openmpi", 6, 3)),
    ("an srun step before its MPI plugin's variables", {**STEP, **MPICH}, ("slurm_step", 2, 0)),
    ("mpiexec from a batch script", {**BATCH, **MPICH}, ("mpi", 7, 2)),
    ("PMIx without PMI", {"PMIX_RANK": "3"}, ("mpi", 3, 0)),
    ("a batch script's own Python", BATCH, ("slurm", 2, 0)),
    ("SLURM_PROCID without SLURM_NTASKS", {"SLURM_PROCID": "2"}, ("single", 0, 0)),
    ("nothing", {}, ("single", 0, 0)),
]  # fmt: skip
IDS = [row[0] for row in TABLE]


@pytest.mark.parametrize(("case", "environ", "expected"), TABLE, ids=IDS)
def test_the_first_source_in_the_documented_order_gives_the_rank(case, environ, expected):
    assert environment_rank(environ) == EnvRank(*expected), case


@pytest.mark.parametrize(("case", "environ", "expected"), TABLE, ids=IDS)
def test_the_rendezvous_follows_the_same_order(monkeypatch, case, environ, expected):
    """``discover_env`` (without mpi4py, as in Alps's venv) takes the rank from the source
    ``environment_rank`` names; a bare PMI launcher is refused there (it needs mpi4py)."""
    from axonn_launch.train.parallel.bootstrap import discover_env

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    runtime = RuntimeConfig(device="cpu", master_port=29500)
    if expected[0] == "mpi":
        with pytest.raises(RuntimeError, match="pip install mpi4py"):
            discover_env(runtime, environ)
        return
    env = discover_env(runtime, environ)
    assert (env.rank, env.local_rank) == expected[1:], case
