"""A launch inside a held Slurm allocation (``salloc``): ``allocation=auto`` runs the job's
batch script, as rendered for sbatch (``submit/render.py``), as a step of that allocation
instead of submitting it; ``allocation=new`` always submits a new job.

Launches by the launcher's own machinery inside a Slurm job (a recovery job's resubmission,
``jobs resubmit``, a sweep's points) always submit a new job: ``batch/resubmit.py`` sets
``allocation=new``, and a sweep point is never run in the allocation of its sweep.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from axonn_launch import scheduler
from axonn_launch.config.compose import ConfigError, LaunchConfig

NODE_VARIABLES = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES")  # the nodes an allocation holds
STREAM_S = 1.0  # how often the step's rank-0 log is printed while it runs


@dataclass(frozen=True)
class Held:
    """The Slurm allocation this launch runs inside: its job id, node count and the CPUs
    it holds on each node (the fewest; 0: unknown)."""

    job_id: str
    nodes: int
    cpus_per_node: int = 0

    def overcommits(self, params: dict) -> bool:
        """Whether the step's tasks ask for more CPUs per node than the allocation holds
        (``salloc -N 2`` holds one per node on a shared partition): then srun overcommits."""
        asked = int(params["ntasks_per_node"]) * int(params.get("cpus_per_task") or 1)
        return 0 < self.cpus_per_node < asked

    def line(self, params: dict) -> str:
        """What the launch says it does, in one line."""
        shared = (
            f", overcommitting its {self.cpus_per_node} CPU(s) per node"
            if self.overcommits(params)
            else ""
        )
        return (
            f"allocation: running as a step of Slurm job {self.job_id} ({params['nodes']} of"
            f" its {self.nodes} nodes{shared}; no sbatch); allocation=new submits a new job"
            " instead; recovery: off inside a held allocation (no recovery job is chained)"
        )


def held(cfg: LaunchConfig, environ: dict[str, str] | None = None) -> Held | None:
    """The allocation a launch of ``cfg`` runs inside: with ``allocation=auto``, a Slurm
    machine, ``SLURM_JOB_ID`` set, and neither a rehearsal nor a sweep's point; else None."""
    environ = os.environ if environ is None else environ
    job_id = environ.get("SLURM_JOB_ID", "")
    if cfg.allocation != "auto" or not scheduler.of(cfg.machine).queued or not job_id:
        return None
    if cfg.rehearse or sweeping():
        return None
    counts = [environ.get(name, "") for name in NODE_VARIABLES]
    nodes = next((int(c) for c in counts if c.isdigit()), 0)
    cpus = environ.get("SLURM_JOB_CPUS_PER_NODE", "")  # e.g. 1(x2) or 8,4(x3)
    counts = [int(n) for n in re.findall(r"(?:^|,)(\d+)", cpus)]
    return Held(job_id=job_id, nodes=nodes, cpus_per_node=min(counts, default=0))


def sweeping() -> bool:
    """Whether this launch is a point of a Hydra multirun (each point is its own job)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def check_fits(cfg: LaunchConfig, nodes: int, tasks_per_node: int) -> Held | None:
    """The held allocation (``held``), once the grid's ``nodes`` fit in it: else one line
    (ConfigError), before anything is written."""
    allocation = held(cfg)
    if allocation is None or nodes <= allocation.nodes:
        return allocation
    raise ConfigError(
        f"allocation=auto: the grid needs {nodes} nodes ({tasks_per_node} tasks per node on"
        f" {cfg.machine.name}), but Slurm job {allocation.job_id} holds {allocation.nodes}"
        f" ({'/'.join(NODE_VARIABLES)}): ask salloc for {nodes} nodes, use a smaller grid,"
        " or allocation=new to submit a new job"
    )


def step_environment(
    params: dict, allocation: Held, environ: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of the batch script run as a step: the allocation's, with srun's
    input variables set to the job's shape (its ``#SBATCH`` lines are comments to bash)."""
    env = dict(os.environ if environ is None else environ)
    nodes, per_node = int(params["nodes"]), int(params["ntasks_per_node"])
    shape = {
        "SLURM_NNODES": nodes,
        "SLURM_NTASKS": nodes * per_node,
        "SLURM_NPROCS": nodes * per_node,
        "SLURM_NTASKS_PER_NODE": per_node,
        "SLURM_CPUS_PER_TASK": params.get("cpus_per_task"),
        "SLURM_GPUS_PER_NODE": params.get("gpus_per_node"),
        "SLURM_GPUS_PER_TASK": params.get("gpus_per_task"),
        "SLURM_OVERCOMMIT": 1 if allocation.overcommits(params) else None,
    }
    env.update({key: str(value) for key, value in shape.items() if value})
    return env


def run_step(
    *, script: Path, folder: Path, job: object, params: dict, allocation: Held, out
) -> int:
    """Run the batch script ``script`` (its srun line starts the job's tasks) as a step of
    ``allocation``, with ``job`` pickled where submitit's tasks look for it; print its
    rank-0 log as it runs. Its exit code."""
    from submitit.core.utils import DelayedSubmission
    from submitit.core.utils import JobPaths as SubmititPaths

    from axonn_launch.scheduler.slurm_jobs import print_new

    paths = SubmititPaths(folder, job_id=allocation.job_id, task_id=0)
    paths.submitted_pickle.parent.mkdir(parents=True, exist_ok=True)  # folder has %j
    DelayedSubmission(job).dump(paths.submitted_pickle)
    step = subprocess.Popen(["bash", str(script)], env=step_environment(params, allocation))
    offsets = {paths.stdout: 0, paths.stderr: 0}
    try:
        while step.poll() is None:
            offsets = {path: print_new(path, at, out) for path, at in offsets.items()}
            time.sleep(STREAM_S)
    except KeyboardInterrupt:  # the script's TERM trap signals the ranks: they save and end
        step.terminate()
        step.wait()
        raise
    for path, at in offsets.items():
        print_new(path, at, out)
    return step.returncode


def step_record(allocation: Held) -> dict:
    """What job.json says of a job run inside a held allocation."""
    return {
        "in_allocation": True,
        "allocation_job_id": allocation.job_id,
        "job_ids": [allocation.job_id],
    }
