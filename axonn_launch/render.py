"""The batch script: one pure function of (machine, grid, nodes, job), per submitit.

``slurm_parameters`` maps a machine profile onto submitit's Slurm parameters and
``render_script`` produces the exact text submitit's SlurmExecutor submits (it calls
the same ``_make_sbatch_string``). Every value from a config is quoted: submitit
quotes ``#SBATCH`` values and srun arguments, and our environment lines go through
``shlex.quote``. The profile's ``setup`` lines are the one place where shell code
is data (module loads and site set-up written by whoever maintains the profile).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from submitit.slurm.slurm import _make_sbatch_string

from axonn_launch.machine import MachineProfile
from axonn_launch.validate import placeholder

# srun arguments every job gets: stop all ranks when one dies (a hung collective otherwise
# waits until the time limit).
COMMON_SRUN_ARGS = ("--kill-on-bad-exit=1",)


def slurm_parameters(
    *, machine: MachineProfile, nodes: int, tasks_per_node: int, job_name: str
) -> dict[str, Any]:
    """submitit ``update_parameters`` keywords for one job."""
    slurm = machine.slurm
    params: dict[str, Any] = {
        "job_name": job_name,
        "nodes": nodes,
        "ntasks_per_node": tasks_per_node,
        "cpus_per_task": slurm.cpus_per_task,
        "time": slurm.time_min,
        "signal_delay_s": slurm.signal_delay_s,
        "setup": setup_lines(machine=machine, nodes=nodes),
        "srun_args": [*COMMON_SRUN_ARGS, *slurm.srun_args],
    }
    optional = {
        "partition": slurm.partition,
        "qos": slurm.qos,
        "constraint": slurm.constraint,
        "account": slurm.account,
        "gpus_per_node": slurm.gpus_per_node,
        "gpus_per_task": slurm.gpus_per_task,
        "exclusive": slurm.exclusive,
    }
    params.update({k: v for k, v in optional.items() if v})
    if "slurm.account" in machine.required and not slurm.account:
        params["account"] = placeholder("slurm.account")
    extra = {"gpu-bind": slurm.gpu_bind, "network": slurm.network, **slurm.extra_sbatch}
    extra = {k: v for k, v in extra.items() if v}
    if extra:
        params["additional_parameters"] = extra
    return params


def setup_lines(*, machine: MachineProfile, nodes: int) -> list[str]:
    """Shell lines run in the batch script before srun: modules, site set-up, environment."""
    lines = []
    if machine.modules:
        lines.append(shlex.join(["module", "load", *machine.modules]))
    lines.extend(machine.setup)
    env = dict(machine.env)
    if nodes > 1:
        env.update(machine.multinode_env)
    lines.extend(f"export {key}={shlex.quote(str(value))}" for key, value in sorted(env.items()))
    return lines


def submitit_command(*, python: str, folder: Path) -> str:
    """The command submitit's SlurmExecutor runs in each task."""
    return " ".join([shlex.quote(python), "-u -m submitit.core._submit", shlex.quote(str(folder))])


def render_script(
    *,
    machine: MachineProfile,
    nodes: int,
    tasks_per_node: int,
    job_name: str,
    folder: Path,
    python: str,
) -> str:
    params = slurm_parameters(
        machine=machine, nodes=nodes, tasks_per_node=tasks_per_node, job_name=job_name
    )
    return _make_sbatch_string(
        command=submitit_command(python=python, folder=folder), folder=folder, **params
    )
