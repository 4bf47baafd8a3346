"""The batch script: one pure function of (machine, grid, nodes, job), per submitit.

``slurm_parameters`` maps a machine profile onto submitit's Slurm parameters and
``render_script`` produces the exact text submitit's SlurmExecutor submits. Every value
from a config is quoted; the profile's ``setup`` lines are the one place where shell code
is data, and each fails fast.

Quoting, fail-fast set-up, signal relay and ``%`` escaping: ``docs/launch.md``
("submit/render.py").
"""

from __future__ import annotations

import getpass
import hashlib
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from submitit.slurm.slurm import _make_sbatch_string

from axonn_launch.common.machine import MachineProfile
from axonn_launch.common.slurmtext import SUBMITIT_TAGS, escape_percent
from axonn_launch.config.resolve import placeholder
from axonn_launch.records.provenance import import_first

# srun arguments every job gets: stop all ranks when one dies (a hung collective otherwise
# waits until the time limit).
COMMON_SRUN_ARGS = ("--kill-on-bad-exit=1",)


@dataclass(frozen=True)
class PythonCopy:
    """The tasks' Python environment on node-local storage (``machine.python_broadcast``):
    packed once on the batch node, sent to every node with ``sbcast``, unpacked there by
    one task per node, as OLCF's sbcast page does with a conda-pack archive
    (olcf/olcf-user-docs:software/python/sbcast_conda.rst). A venv's ``bin/python`` finds
    its ``pyvenv.cfg`` and site-packages next to itself, so the copy runs where it lands.

    An editable install (``pip install -e``) leaves the package in the checkout, which the
    venv only points to: then the package is packed too, and put first on the tasks'
    ``PYTHONPATH``, so that they import the copy, not the checkout on the shared
    filesystem."""

    source: str  # the environment's root (a venv or conda env) on the shared filesystem
    dir: str  # this job's directory on every node's local storage
    python: str  # the interpreter the tasks run: inside the copy
    package: str = ""  # the folder holding axonn_launch when the venv does not; "" = none

    def commands(self) -> list[str]:
        """Shell commands for the batch script, run before the job's srun."""
        folder = PurePosixPath(self.dir)
        parts = [("env", self.source, ".")]
        if self.package:
            parts.append(("src", self.package, PACKAGE))
        packed = [(f"{self.dir}.{name}.packed.tar", f"{self.dir}.{name}.tar") for name, *_ in parts]
        pack = " && ".join(
            f"tar -C {shlex.quote(src)} -cf {shlex.quote(tar)} {member}"
            for (_, src, member), (tar, _) in zip(parts, packed)
        )
        send = " && ".join(shlex.join(["sbcast", "-f", tar, sent]) for tar, sent in packed)
        unpack = " && ".join(
            [
                f"rm -rf {shlex.quote(self.dir)}",
                *(
                    f"mkdir -p {shlex.quote(str(folder / name))}"
                    f" && tar -xf {shlex.quote(sent)} -C {shlex.quote(str(folder / name))}"
                    f" && rm -f {shlex.quote(sent)}"
                    for (name, *_), (_, sent) in zip(parts, packed)
                ),
            ]
        )
        commands = [
            f"mkdir -p {shlex.quote(str(folder.parent))} && {pack}",
            f"{send} && rm -f {' '.join(shlex.quote(tar) for tar, _ in packed)}",
            # one task per node: the batch environment's SLURM_NTASKS would otherwise ask for
            # the job's task count, and that many tasks would unpack into each node at once
            'srun --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1'
            " --kill-on-bad-exit=1 sh -c " + shlex.quote(unpack),
        ]
        if self.package:  # before the checkout that the venv's editable install names,
            # and before the working directory, which ``python -m`` puts first (3.11 and up:
            # PYTHONSAFEPATH; a job started from the checkout would import it from there)
            src = shlex.quote(str(folder / "src"))
            commands.append(
                f'export PYTHONPATH={src}"${{PYTHONPATH:+:$PYTHONPATH}}" PYTHONSAFEPATH=1'
            )
        return commands


PACKAGE = "axonn_launch"


def package_outside(venv: str) -> str:
    """The folder holding this package when it is not inside ``venv`` (an editable
    install imports it from the checkout), else ``""``: a copy of the venv alone would
    still import the checkout."""
    folder = Path(__file__).resolve().parents[2]  # <folder>/axonn_launch/submit/render.py
    return "" if folder.is_relative_to(Path(venv).resolve()) else str(folder)


def python_copy(
    machine: MachineProfile, *, nodes: int, python: str, folder: Path
) -> PythonCopy | None:
    """Where ``machine.python_broadcast`` puts the environment of ``python`` (the tasks'
    interpreter) for the job whose submitit folder is ``folder``; None when it is off."""
    if not machine.broadcasts(nodes):
        return None
    interpreter = PurePosixPath(python)  # not resolved: a venv's python is a symlink
    tag = hashlib.sha1(str(folder).encode()).hexdigest()[:12]
    base = machine.broadcast.dir.format(user=getpass.getuser())
    job_dir = f"{base.rstrip('/')}/axonn-{tag}"
    source = str(interpreter.parent.parent)
    return PythonCopy(
        source=source,
        dir=job_dir,
        python=f"{job_dir}/env/bin/{interpreter.name}",
        package=package_outside(source),
    )


def slurm_parameters(
    *,
    machine: MachineProfile,
    nodes: int,
    tasks_per_node: int,
    job_name: str,
    copy: PythonCopy | None = None,
    code: str = "",
) -> dict[str, Any]:
    """submitit ``update_parameters`` keywords for one job; ``code``: the job's snapshot of
    the package, which its tasks import (``setup_lines``)."""
    slurm = machine.slurm
    params: dict[str, Any] = {
        "job_name": job_name,
        "nodes": nodes,
        "ntasks_per_node": tasks_per_node,
        "cpus_per_task": slurm.cpus_per_task,
        "time": slurm.limit_min(nodes),
        "signal_delay_s": slurm.signal_delay_s,
        "setup": setup_lines(machine=machine, nodes=nodes, copy=copy, code=code),
        "srun_args": [*COMMON_SRUN_ARGS, *slurm.srun_args],
        # no ``--wckey=submitit`` (submitit's default), which a site that enforces wckeys
        # may refuse; a profile that needs one sets ``slurm.extra_sbatch.wckey``
        "wckey": None,
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
    if copy and machine.broadcast.constraint:
        both = [c for c in (slurm.constraint, machine.broadcast.constraint) if c]
        params["constraint"] = "&".join(both)
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


# exported last, just before srun: each rank measures its start-up from here
# (train/health/startup.py)
SRUN_START = 'export AXONN_SRUN_START="$(date +%s.%N)"'


def setup_lines(
    *, machine: MachineProfile, nodes: int, copy: PythonCopy | None = None, code: str = ""
) -> list[str]:
    """Shell lines run in the batch script before srun: modules, site set-up, environment,
    the node-local copy of the tasks' Python, and the start time of srun. ``code``: the
    folder holding the job's snapshot of the package (``code_snapshot``), put first on
    ``PYTHONPATH`` for everything after (the tasks, ``axonn_launch.restart``); a node-local
    copy carries it in place of the checkout (records/provenance.py)."""
    if copy and code:
        copy = replace(copy, package=code)
    commands = []
    if machine.modules:
        commands.append(shlex.join(["module", "load", *machine.modules]))
    commands.extend(machine.setup)
    if copy:
        commands.extend(copy.commands())
    lines = [SETUP_FUNCTION] if commands else []
    lines.extend(f"axonn_setup {n} {shlex.quote(c)}" for n, c in enumerate(commands, start=1))
    env = dict(machine.env)
    if nodes > 1:
        env.update(machine.multinode_env)
    if copy:
        env["AXONN_PYTHON_FROM"] = copy.source
    lines.extend(f"export {key}={shlex.quote(str(value))}" for key, value in sorted(env.items()))
    if code and not copy:  # on srun's start line: a dry run prints the script, in 80 lines
        return [*lines, f"{import_first(code)} {SRUN_START.removeprefix('export ')}"]
    return [*lines, SRUN_START]


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
    copy = python_copy(machine, nodes=nodes, python=machine.task_python(python), folder=folder)
    params = slurm_parameters(
        machine=machine, nodes=nodes, tasks_per_node=tasks_per_node, job_name=job_name, copy=copy
    )
    return script_of(params, folder=folder, python=tasks_python(machine, python, copy))


def tasks_python(machine: MachineProfile, login_python: str, copy: PythonCopy | None) -> str:
    """The interpreter srun starts: the node-local copy's, else ``machine.task_python``."""
    return copy.python if copy else machine.task_python(login_python)


def script_of(
    params: dict[str, Any], *, folder: Path, python: str, restarts: InPlace | None = None
) -> str:
    """The batch script submitit makes of ``params`` (``slurm_parameters``, or a
    rehearsal's substitution of them) for tasks that run ``python``, with its signals
    relayed to the ranks (``relay_signals``) and, with ``restarts``, its training step
    run again in place after a failure (``restart_in_place``)."""
    command = submitit_command(python=python, folder=folder)
    return as_submitted(_make_sbatch_string(command=command, folder=folder, **params), restarts)


def as_submitted(script: str, restarts: InPlace | None = None) -> str:
    """submitit's batch script as the launcher submits it: its log paths' ``%`` escaped
    (``escape_log_paths``), its signals relayed to the ranks (``relay_signals``) and its
    training step restarted in place (``restart_in_place``, when ``restarts`` is given)."""
    relayed = relay_signals(escape_log_paths(script))
    return restart_in_place(relayed, restarts) if restarts else relayed


LOG_FLAGS = ("--output", "--error")  # the filename options submitit writes
_SUBMITIT_TAG = re.compile("(" + "|".join(re.escape(tag) for tag in SUBMITIT_TAGS) + ")")


def log_path_pattern(path: str) -> str:
    """A submitit log path as a Slurm filename pattern: its ``%j``, ``%t``, ``%A`` and
    ``%a`` (submitit's tags, which Slurm expands alike) kept, every other ``%`` doubled. A
    job dir holding one of those tags is refused (``resolve.check_job_dir``), so every tag
    here is submitit's."""
    parts = _SUBMITIT_TAG.split(path)
    return "".join(part if n % 2 else escape_percent(part) for n, part in enumerate(parts))


def escape_log_paths(script: str) -> str:
    """``script`` with the paths of its ``#SBATCH --output/--error`` lines and of its srun
    line's ``--output/--error`` as Slurm filename patterns (``log_path_pattern``). A line
    whose paths hold no other ``%`` is left as submitit wrote it."""
    lines = script.split("\n")
    for n, line in enumerate(lines):
        flag, _, value = line.removeprefix("#SBATCH ").partition("=")
        if line.startswith("#SBATCH ") and flag in LOG_FLAGS:
            path = shlex.split(value)[0]
            if log_path_pattern(path) != path:
                lines[n] = f"#SBATCH {flag}={shlex.quote(log_path_pattern(path))}"
        elif line.startswith("srun "):
            words = shlex.split(line)
            for at in [words.index(f) + 1 for f in LOG_FLAGS if f in words[:-1]]:
                words[at] = log_path_pattern(words[at])
            if words != shlex.split(line):
                lines[n] = shlex.join(words)
    return "\n".join(lines)


# Defined just before srun starts (a signal during the set-up still ends the script, before
# any rank runs). axonn_wait waits for srun, and again after each signal the shell handles
# (``wait`` returns early then), then returns srun's own exit status (bash keeps it).
RELAY_FUNCTION = (
    "axonn_wait() {",
    '  axonn_srun="$1"',
    "  trap 'axonn_signalled=1; kill -s USR2 \"$axonn_srun\" 2>/dev/null' USR2",
    "  trap 'axonn_signalled=1; scancel --signal=TERM \"$SLURM_JOB_ID\" >/dev/null 2>&1' TERM",
    '  while kill -0 "$axonn_srun" 2>/dev/null; do wait "$axonn_srun"; done',
    '  wait "$axonn_srun"',
    "}",
)
RELAY_COMMENT = "# srun in the background: USR2 and TERM to this shell reach the ranks (axonn_wait)"
RELAY_SUFFIX = ' & axonn_wait "$!"'


def relay_signals(script: str) -> str:
    """``script`` (submitit's batch script) with its srun line run in the background and
    waited for by ``axonn_wait``, so that a USR2 or TERM to the batch shell reaches the
    ranks (module docstring). The srun line itself stays one line, as submitit wrote it."""
    lines = script.split("\n")
    (at,) = [n for n, line in enumerate(lines) if line.startswith("srun ")]
    lines[at : at + 1] = [*RELAY_FUNCTION, RELAY_COMMENT, lines[at] + RELAY_SUFFIX]
    return "\n".join(lines)


@dataclass(frozen=True)
class InPlace:
    """Restarts of the training step inside its own Slurm job (``recovery.in_job_restarts``):
    the step runs on ``nodes`` of the job's nodes (the rest are spares) with ``tasks``
    tasks; after a failure that no signal caused, ``python -m axonn_launch.restart
    <job_dir> <exit status>`` decides (``batch/restart.py``) and prints the next step's
    srun options, or exits non-zero and the job ends as the step did."""

    python: str  # the interpreter that runs the decision: the launcher's own
    job_dir: str
    nodes: int
    tasks: int
    # a packed sweep's point: its first step runs on the nodes its pack names in this
    # variable (batch/pack_runner.py)
    nodes_variable: str = ""

    def first_step(self) -> str:
        shape = f"--nodes={self.nodes} --ntasks={self.tasks}"
        return f'{shape} "--nodelist=${self.nodes_variable}"' if self.nodes_variable else shape


RESTART_COMMENT = "# restarts in place (recovery.in_job_restarts)"


def restart_in_place(script: str, restarts: InPlace) -> str:
    """``script`` (relayed: ``relay_signals``) with its srun line in a loop: the first step
    on ``restarts.nodes`` nodes, each next one where ``axonn_launch.restart`` says. The
    options it prints are node names and counts, read as words, never run by a shell."""
    lines = script.split("\n")
    (at,) = [n for n, line in enumerate(lines) if line.startswith("srun ")]
    decide = " ".join(
        shlex.quote(word)
        for word in (restarts.python, "-m", "axonn_launch.restart", restarts.job_dir)
    )
    lines[at : at + 1] = [
        f"axonn_step=({restarts.first_step()}); while :; do  {RESTART_COMMENT}",
        lines[at].replace("srun ", 'srun "${axonn_step[@]}" ', 1),
        'axonn_rc=$?; [ "$axonn_rc" = 0 ] || [ -n "${axonn_signalled:-}" ] && exit "$axonn_rc"',
        f'axonn_next="$({decide} "$axonn_rc")" || exit "$axonn_rc"'
        '; read -r -a axonn_step <<<"$axonn_next"; done',
    ]
    return "\n".join(lines)
