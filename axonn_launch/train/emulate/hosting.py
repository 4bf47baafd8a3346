"""Which emulated ranks this process hosts, each rank's environment, and where the
rendezvous is.

A launcher that starts one task per rank (the real batch script: ``srun`` with the
machine's tasks per node, or the local supervisor) starts hosts and idle tasks: the task
whose local rank is a multiple of ``train.emulate_host_ranks`` (0: of the tasks on its
node, so one host per node) hosts that many ranks from its own on, and the others end
at once without importing torch. A launcher that starts fewer tasks (one per node,
``--ntasks-per-node=1``) makes each task the host of an equal block of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from axonn_launch.common.ranks import environment_rank
from axonn_launch.common.slurmtext import expand_hostlist
from axonn_launch.common.spec import JobSpec

SLURM_PORT_RANGE = 2000  # as train/parallel/bootstrap.py: master_port + job id % this
# the variables that carry a task's rank and local rank, per launcher (common/ranks.py)
RANK_VARIABLES = {"torchrun": ("RANK", "LOCAL_RANK"), "slurm": ("SLURM_PROCID", "SLURM_LOCALID"),
                  "slurm_step": ("SLURM_PROCID", "SLURM_LOCALID")}  # fmt: skip


@dataclass(frozen=True)
class Hosting:
    task: int  # this task's rank among the launcher's tasks
    ranks: tuple[int, ...]  # the emulated ranks it hosts (none: an idle task)
    first_local: int  # the local rank of the first of them on its node
    world_size: int  # emulated ranks in the job
    node_ranks: int  # emulated ranks on this task's node
    source: str  # the launcher, as common/ranks.py names it


def task_counts(environ: Mapping[str, str]) -> tuple[int, int]:
    """(tasks in the job, tasks on this node), from the launcher's variables."""
    tasks = int(environ.get("WORLD_SIZE") or environ.get("SLURM_NTASKS") or 1)
    if environ.get("LOCAL_WORLD_SIZE"):
        return tasks, int(environ["LOCAL_WORLD_SIZE"])
    nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    return tasks, max(1, tasks // nodes)


def hosting(spec: JobSpec, environ: Mapping[str, str]) -> Hosting:
    """This task's share of the emulated ranks (module docstring)."""
    found = environment_rank(environ)
    world = spec.grid.world_size
    tasks, here = task_counts(environ)
    if tasks == world:
        per = spec.train.emulate_host_ranks or here
        offset = found.local_rank % per
        last = min(found.rank - offset + per, found.rank - found.local_rank + here, world)
        ranks = () if offset else tuple(range(found.rank, last))
        return Hosting(found.rank, ranks, found.local_rank, world, here, found.source)
    if world % tasks:
        raise ValueError(
            f"train.emulate=true: {tasks} tasks cannot host {world} ranks evenly; start one"
            " task per rank, or a number of tasks that divides the grid's world size"
        )
    per = world // tasks
    ranks = tuple(range(found.rank * per, (found.rank + 1) * per))
    return Hosting(found.rank, ranks, 0, world, per * here, found.source)


def rank_environ(environ: Mapping[str, str], host: Hosting, rank: int) -> dict[str, str]:
    """The environment the launcher would have given ``rank``: the host's, with the
    rank's own rank and local rank."""
    names = RANK_VARIABLES.get(host.source)
    env = dict(environ)
    if names is not None:
        env[names[0]] = str(rank)
        env[names[1]] = str(host.first_local + rank - host.ranks[0])
    return env


def rendezvous_address(spec: JobSpec, environ: Mapping[str, str]) -> tuple[str, int]:
    """The store's host and port as the job's rendezvous derives them
    (``train/parallel/bootstrap.py``, which imports torch: the same rule, read here)."""
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    host = environ.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1")
    job = int(environ.get("SLURM_JOB_ID", "0")) + int(environ.get("SLURM_STEP_ID", "0") or 0)
    default = spec.runtime.master_port + (job % SLURM_PORT_RANGE if nodelist else 0)
    return host, int(environ.get("MASTER_PORT", default))
