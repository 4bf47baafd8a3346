"""Find this process's rank, rendezvous address, device and backend.

The launcher is recognized in ``common/ranks.py``'s order, which every reader of the rank
shares; this module adds what the rendezvous needs for each: the master address (from
the step's node list, or broadcast over MPI), the local rank, the device and the backend.
``MASTER_ADDR``/``MASTER_PORT`` in the environment override the derived address and port.

Each source, and what was measured on the local cluster: ``docs/job-side.md``
("train/parallel/bootstrap.py").
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from axonn_launch.common.ranks import rank_source
from axonn_launch.common.slurmtext import expand_hostlist
from axonn_launch.common.spec import RuntimeConfig

SLURM_PORT_RANGE = 2000  # Slurm jobs use master_port + job_id % this, so concurrent jobs differ


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    device: str  # "cpu" or "cuda:<index>"
    backend: str  # "gloo" or "nccl"
    source: str  # torchrun | slurm | mpi | single


@dataclass(frozen=True)
class _Ranks:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str


def discover_env(runtime: RuntimeConfig, environ: Mapping[str, str] | None = None) -> DistEnv:
    """Rank, rendezvous and device of this process, from its environment."""
    env = os.environ if environ is None else environ
    ranks = _ranks_from_environment(env, runtime)
    device = choose_device(runtime, ranks.local_rank)
    return DistEnv(
        rank=ranks.rank,
        local_rank=ranks.local_rank,
        world_size=ranks.world_size,
        local_world_size=ranks.local_world_size,
        master_addr=ranks.master_addr,
        master_port=ranks.master_port,
        device=device,
        backend=choose_backend(runtime, device),
        source=ranks.source,
    )


def _ranks_from_environment(env: Mapping[str, str], runtime: RuntimeConfig) -> _Ranks:
    """The numbers from the source ``common.ranks.rank_source`` names (its order)."""
    source = rank_source(env)
    if source == "single":
        return _Ranks(0, 0, 1, 1, "127.0.0.1", runtime.master_port, "single")
    readers = {"torchrun": _from_torchrun, "openmpi": _from_mpi, "slurm_step": _from_slurm,
               "mpi": _from_mpi, "slurm": _from_slurm}  # fmt: skip
    return readers[source](env, runtime)


# (rank, local rank, world size, local world size): the variables a launcher sets in each task
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
OPENMPI_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_SIZE")  # fmt: skip


def _from_torchrun(env: Mapping[str, str], runtime: RuntimeConfig) -> _Ranks:
    return _from_variables(env, TORCHRUN_VARS, runtime, "torchrun")


def _from_variables(
    env: Mapping[str, str], names: tuple[str, str, str, str], runtime: RuntimeConfig, source: str
) -> _Ranks:
    """The one builder from a launcher's variables (``names``: ``TORCHRUN_VARS``...); the
    master is ``MASTER_ADDR``, else this host (one node)."""
    rank, local_rank, size, local_size = names
    world = int(env[size])
    return _Ranks(
        rank=int(env[rank]),
        local_rank=int(env.get(local_rank, "0")),
        world_size=world,
        local_world_size=int(env.get(local_size, world)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_master_port(env, runtime.master_port),
        source=source,
    )


def _master_port(env: Mapping[str, str], default: int) -> int:
    """``MASTER_PORT`` when the launcher set it, else ``default``."""
    return int(env.get("MASTER_PORT", default))


def _from_slurm(env: Mapping[str, str], runtime: RuntimeConfig) -> _Ranks:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    hosts = expand_hostlist(nodelist) if nodelist else ["127.0.0.1"]
    # a restart in place (submit/in_job.py) is a new step of the same job: a port of its own
    job_id = int(env.get("SLURM_JOB_ID", "0")) + int(env.get("SLURM_STEP_ID", "0") or 0)
    world = int(env["SLURM_NTASKS"])
    return _Ranks(
        rank=int(env["SLURM_PROCID"]),
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        world_size=world,
        local_world_size=_slurm_local_world_size(env, world),
        master_addr=env.get("MASTER_ADDR", hosts[0]),
        master_port=_master_port(env, runtime.master_port + job_id % SLURM_PORT_RANGE),
        source="slurm",
    )


def _slurm_local_world_size(env: Mapping[str, str], world: int) -> int:
    """Tasks on this node: ``SLURM_TASKS_PER_NODE`` looks like ``4(x2),3``."""
    per_node = env.get("SLURM_TASKS_PER_NODE", "")
    node_id = int(env.get("SLURM_NODEID", "0"))
    counts: list[int] = []
    for item in filter(None, per_node.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if match is None:
            return world
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_id] if node_id < len(counts) else world


def _from_mpi(env: Mapping[str, str], runtime: RuntimeConfig) -> _Ranks:
    try:
        from mpi4py import MPI
    except ImportError:
        if "OMPI_COMM_WORLD_RANK" in env:
            return _from_openmpi_variables(env, runtime)
        raise RuntimeError(
            "launched by an MPI launcher outside Slurm (PMI/PMIx variables, no SLURM_STEP_ID)"
            " but mpi4py is not installed: pip install mpi4py, or start the ranks with srun"
        ) from None
    comm = MPI.COMM_WORLD
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    master_addr = comm.bcast(socket.gethostname() if comm.Get_rank() == 0 else None, root=0)
    ranks = _Ranks(
        rank=comm.Get_rank(),
        local_rank=node_comm.Get_rank(),
        world_size=comm.Get_size(),
        local_world_size=node_comm.Get_size(),
        master_addr=env.get("MASTER_ADDR", master_addr),
        master_port=_master_port(env, runtime.master_port),
        source="mpi",
    )
    node_comm.Free()
    return ranks


def _from_openmpi_variables(env: Mapping[str, str], runtime: RuntimeConfig) -> _Ranks:
    """Open MPI's own variables give the ranks (mpirun without mpi4py)."""
    return _from_variables(env, OPENMPI_VARS, runtime, "mpi")


# the variable each srun --mpi plugin sets in every task (as measured on the local cluster)
MPI_PLUGIN_VARS = (("PMIX_RANK", "pmix"), ("PMI_RANK", "pmi2"), ("PALS_RANKID", "cray_shasta"))


def launcher_words(env: DistEnv, environ: Mapping[str, str] | None = None) -> str:
    """Where this rank's numbers came from, e.g. ``slurm step (srun --mpi=pmix)``."""
    environ = os.environ if environ is None else environ
    plugin = next((name for var, name in MPI_PLUGIN_VARS if var in environ), "")
    if env.source == "slurm":
        step = "slurm step" if "SLURM_STEP_ID" in environ else "slurm"
        return f"{step} (srun --mpi={plugin or 'none'})"
    return env.source


def choose_device(runtime: RuntimeConfig, local_rank: int) -> str:
    wanted = runtime.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cpu":
        return "cpu"
    if wanted != "cuda":
        raise ValueError(f"runtime.device={runtime.device!r}: use auto, cpu or cuda")
    if runtime.device_index == "local_rank":
        return f"cuda:{local_rank}"
    if runtime.device_index == "zero":
        return "cuda:0"
    raise ValueError(f"runtime.device_index={runtime.device_index!r}: use local_rank or zero")


def choose_backend(runtime: RuntimeConfig, device: str) -> str:
    if runtime.backend != "auto":
        return runtime.backend
    return "nccl" if device != "cpu" and torch.cuda.is_available() else "gloo"


def init_distributed(env: DistEnv, *, timeout_s: float = 600.0) -> None:
    """Join the process group; a one-process world uses an in-memory store (no port)."""
    if env.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(env.device))
    timeout = timedelta(seconds=timeout_s)
    if env.world_size == 1:
        dist.init_process_group(
            env.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    dist.init_process_group(
        env.backend,
        init_method=f"tcp://{_url_host(env.master_addr)}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
