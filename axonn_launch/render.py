"""The batch script: one pure function of (machine, grid, nodes, job), per submitit.

``slurm_parameters`` maps a machine profile onto submitit's Slurm parameters and
``render_script`` produces the exact text submitit's SlurmExecutor submits (it calls
the same ``_make_sbatch_string``). Every value from a config is quoted: submitit
quotes ``#SBATCH`` values and srun arguments, and our environment lines go through
``shlex.quote``. The profile's ``setup`` lines are the one place where shell code
is data (module loads and site set-up written by whoever maintains the profile).

Fail fast: each module load and set-up line runs as ``axonn_setup N 'LINE'``, which
evaluates it in the batch shell and, when it fails, prints the line and its exit code to
the job's error log and ends the script before srun starts (a broken environment never
reaches the ranks). A line's status is that of its last command, as for any shell line.
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


SETUP_FUNCTION = (
    'axonn_setup() { eval "$2" || { echo "axonn_launch: setup line $1 failed (exit $?): $2;'
    ' srun not started" >&2; exit 1; }; }'
)


def setup_lines(*, machine: MachineProfile, nodes: int) -> list[str]:
    """Shell lines run in the batch script before srun: modules, site set-up, environment."""
    commands = []
    if machine.modules:
        commands.append(shlex.join(["module", "load", *machine.modules]))
    commands.extend(machine.setup)
    lines = [SETUP_FUNCTION] if commands else []
    lines.extend(f"axonn_setup {n} {shlex.quote(c)}" for n, c in enumerate(commands, start=1))
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
    """The batch script; ``python`` is the login node's interpreter, used only when the
    machine names none of its own (``MachineProfile.task_python``)."""
    params = slurm_parameters(
        machine=machine, nodes=nodes, tasks_per_node=tasks_per_node, job_name=job_name
    )
    return script_of(params, folder=folder, python=machine.task_python(python))


def script_of(params: dict[str, Any], *, folder: Path, python: str) -> str:
    """The batch script submitit makes of ``params`` (``slurm_parameters``, or a
    rehearsal's substitution of them) for tasks that run ``python``."""
    command = submitit_command(python=python, folder=folder)
    return _make_sbatch_string(command=command, folder=folder, **params)
