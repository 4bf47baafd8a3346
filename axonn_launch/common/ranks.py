"""Which launcher started this process, and its rank, from the environment alone.

One order for every reader: the job's rendezvous (``train/parallel/bootstrap.py``), the
fault hooks and the Slurm task's per-rank variables (``submit/task.py``), the local rank
process (``train/__main__.py``). First match wins: ``torchrun``, ``openmpi``,
``slurm_step``, ``mpi``, ``slurm``, ``single``.

What each source reads: ``docs/job-side.md`` ("common/ranks.py").
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

MPI_DETECT_VARS = ("PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
# (rank, local rank) variables of each source; the first set one of each list counts
RANK_VARS = {
    "torchrun": (("RANK",), ("LOCAL_RANK",)),
    "openmpi": (("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    "slurm_step": (("SLURM_PROCID",), ("SLURM_LOCALID",)),
    "mpi": (("PMI_RANK", "PMIX_RANK"), ("MPI_LOCALRANKID",)),
    "slurm": (("SLURM_PROCID",), ("SLURM_LOCALID",)),
    "single": ((), ()),
}


@dataclass(frozen=True)
class EnvRank:
    source: str  # a key of RANK_VARS
    rank: int
    local_rank: int


def rank_source(environ: Mapping[str, str]) -> str:
    """The launcher that set ``environ``, in the order of this module's docstring."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return "openmpi"
    slurm_task = "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ
    if slurm_task and "SLURM_STEP_ID" in environ:
        return "slurm_step"
    if any(name in environ for name in MPI_DETECT_VARS):
        return "mpi"
    return "slurm" if slurm_task else "single"


def environment_rank(environ: Mapping[str, str]) -> EnvRank:
    """This process's rank and local rank as its launcher's variables give them (0 where
    the source sets none: an MPI launcher may leave the local rank to mpi4py, which the
    rendezvous asks)."""
    source = rank_source(environ)
    rank_vars, local_vars = RANK_VARS[source]
    return EnvRank(source, _first_int(environ, rank_vars), _first_int(environ, local_vars))


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    """The node this process runs on, as the scheduler names it (Slurm's node name, which
    the scheduler's node lists and a lost node's records use), else the host's name."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def _first_int(environ: Mapping[str, str], names: tuple[str, ...]) -> int:
    return int(next((environ[n] for n in names if environ.get(n)), "0"))
