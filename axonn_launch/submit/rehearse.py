"""A rehearsal: a site machine's real batch script, run on the local Slurm cluster.

``rehearse=true`` renders the batch script of a site machine through the same code as a
real submission, then changes a short, fixed list of site-only parts so that it runs on
``machines/slurm_local``; what a substitution could hide is checked and reported instead
(``Rehearsal.checks``, ``Rehearsal.warnings``). Never imports torch.

What is substituted and what runs as rendered: ``docs/launch.md`` ("submit/rehearse.py").
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from axonn_launch.common.machine import MachineProfile
from axonn_launch.config import edf
from axonn_launch.config.compose import ConfigError, LaunchConfig, machine_profile
from axonn_launch.config.rehearsal import (  # noqa: F401 (what a rehearsal resolves: config/)
    LOCAL_MACHINE,
    MAX_PARAMS,
    NODES,
    check_machine,
    rehearsal_nodes,
    site_config,
    site_machines,
)
from axonn_launch.scheduler.slurm import SLURM

LOCAL_CLUSTER = "axonn"  # ClusterName in machines/slurm_local (lib.sh)
START_SCRIPT = "machines/slurm_local/start.sh"
LOCAL_NODE_CPUS = 8  # what machines/slurm_local/lib.sh declares per node (CPUS_PER_NODE)
MODULE_FUNCTION = (
    'module() { echo "axonn_launch rehearsal: module $*" >&2; }  # the site\'s modules, recorded'
)
GPU_FLAGS = ("--gpus", "--gpu-bind", "--gres=gpu", "--gpus-per-task", "--gpus-per-node")
SLINGSHOT_FLAGS = ("--network",)
CONTAINER_FLAGS = ("--environment",)


@dataclass(frozen=True)
class Rehearsal:
    """What a rehearsal of ``site`` changes (``substitutions``) and checks instead."""

    site: str
    local: MachineProfile
    node_cpus: int
    substitutions: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    edf_env: dict[str, str] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {
            "rehearsal_of": self.site,
            "substitutions": self.substitutions,
            "checks": self.checks,
            "warnings": self.warnings,
        }

    def describe(self) -> str:
        lines = [f"rehearsal  {self.site}'s batch script on the local cluster; substituted:"]
        lines += [f"  - {s}" for s in self.substitutions]
        lines += [f"  checked: {c}" for c in self.checks]
        return "\n".join(lines)


def as_run(cfg: LaunchConfig, rehearsal: Rehearsal) -> LaunchConfig:
    """After validation on the site's hardware: the ranks run gloo on the CPU and the
    preflight compares with the local cluster's floors."""
    hardware = replace(cfg.machine.hardware, peak_tflops_per_gpu=0.0)
    machine = replace(
        cfg.machine, backend="gloo", hardware=hardware, preflight=rehearsal.local.preflight
    )
    return replace(cfg, machine=machine)


def prepare(cfg: LaunchConfig, job_dir: str) -> Rehearsal:
    """Check the local cluster and what the substitutions hide; list the substitutions.
    ``cfg`` is the configuration as the user gave it (the site's own)."""
    check_machine(cfg)
    machine = cfg.machine
    found, warnings = None, []
    if machine.container.engine == "edf":
        found, note = load_edf(machine)
        warnings += [note] if note else []
    try:
        node_cpus = local_cluster_cpus()
    except ConfigError as exc:
        if not cfg.dry_run:
            raise
        node_cpus = LOCAL_NODE_CPUS
        warnings.append(f"{exc} (a real rehearsal stops here)")
    local = machine_profile(LOCAL_MACHINE)
    subs = [
        "module: a shell function that records each call in the job log"
        if machine.modules
        else "module: none loaded by this profile",
    ]
    checks = []
    if found is not None:
        subs.append(
            f"--environment={machine.container.environment}: dropped; its EDF {found.path}"
            f" was read (image {found.image}) and its [env] exported"
            f" ({', '.join(sorted(found.env)) or 'none'})"
        )
        checks = container_checks(machine, found)
        warnings += job_dir_warnings(machine, found, job_dir)
    return Rehearsal(
        site=machine.name,
        local=local,
        node_cpus=node_cpus,
        substitutions=subs + slurm_substitutions(machine, local, node_cpus, rehearsal_nodes(cfg)),
        checks=checks,
        warnings=warnings,
        edf_env=dict(found.env) if found else {},
    )


def container_checks(machine: MachineProfile, found: edf.EDF) -> list[str]:
    """What dropping ``--environment`` could hide: the interpreter the site's tasks would
    run must be inside the container's mounts, or named by ``machine.python``."""
    checks = [f"EDF {found.path}: valid TOML, an image, mounts {found.mount_list()}"]
    interpreter = machine.task_python(sys.executable)
    if machine.python:
        return checks + [f"interpreter {interpreter}: named by machine.python"]
    if found.covers(interpreter):
        return checks + [f"interpreter {interpreter}: inside the container's mounts"]
    raise ConfigError(
        f"machine.container.python={interpreter!r}: outside the container's mounts"
        f" ({found.mount_list()}); the tasks could not start it on {machine.name}"
    )


def job_dir_warnings(machine: MachineProfile, found: edf.EDF, job_dir: str) -> list[str]:
    """Local paths differ from the site's: a job dir the mounts miss only warns here."""
    if found.covers(job_dir):
        return []
    return [
        f"job dir {job_dir}: outside the container's mounts ({found.mount_list()});"
        f" fine for this rehearsal, but a real submission to {machine.name} refuses it"
    ]


def slurm_substitutions(
    machine: MachineProfile, local: MachineProfile, node_cpus: int, nodes: int
) -> list[str]:
    """The Slurm, interpreter, backend and storage substitutions, in words."""
    slurm = machine.slurm
    subs = []
    gpu = [f"--gpus-per-node={slurm.gpus_per_node}"] if slurm.gpus_per_node else []
    gpu += [f"--gpus-per-task={slurm.gpus_per_task}"] if slurm.gpus_per_task else []
    gpu += [f"--gpu-bind={slurm.gpu_bind}"] if slurm.gpu_bind else []
    gpu += [f"-C {slurm.constraint}"] if slurm.constraint else []
    if gpu:
        subs.append(f"GPU flags dropped: {' '.join(gpu)}")
    if slurm.network or any(a.startswith(SLINGSHOT_FLAGS) for a in slurm.srun_args):
        subs.append("Slingshot flags dropped: --network=...")
    site_queue = ", ".join(
        f"{k} {v}" for k, v in (("partition", slurm.partition), ("qos", slurm.qos)) if v
    )
    subs.append(
        f"queue: {site_queue or 'the default'} and the site account -> partition"
        f" {local.slurm.partition} of the local cluster, no account or QOS"
    )
    tasks = machine.hardware.gpus_per_node
    subs.append(
        f"CPUs per task: {slurm.cpus_per_task} -> {local_cpus_per_task(node_cpus, tasks)}"
        f" ({node_cpus} CPUs per local node / {tasks} tasks)"
    )
    site_python = machine.task_python(sys.executable)
    subs.append(
        f"interpreter: {site_python} -> {sys.executable}"
        if site_python != sys.executable
        else f"interpreter: the login node's own ({sys.executable}), as on {machine.name}"
    )
    subs.append(
        f"ranks: backend {machine.backend} on GPUs -> gloo on the CPU; preflight floors ->"
        " the local cluster's"
    )
    if machine.broadcasts(nodes):
        need = f" (-C {machine.broadcast.constraint})" if machine.broadcast.constraint else ""
        subs.append(
            f"node-local storage for the Python copy: {machine.broadcast.dir}{need} ->"
            f" {local.broadcast.dir}, each local node's own"
        )
    if slurm.mpi_default and not _names_mpi(slurm.srun_args):
        subs.append(f"MPI plugin: the site's default made explicit: --mpi={slurm.mpi_default}")
    return subs


def load_edf(machine: MachineProfile) -> tuple[edf.EDF, str]:
    """The EDF ``srun --environment=`` would read, and ``""``; when the search path has
    none, the project's own (``machines/<machine>/``, the file users copy to ``~/.edf``)
    and a warning that says so: a rehearsal needs no set-up step of the site's."""
    environment = machine.container.environment
    try:
        path, note = edf.locate(environment), ""
    except edf.EDFError as exc:
        path = edf.project_copy(environment, machine.name)
        if path is None:
            raise ConfigError(str(exc)) from None
        note = (
            f"no {environment}.toml in the EDF search path (EDF_PATH, then ~/.edf): this"
            f" rehearsal uses the project's own {path}; before a real submission to"
            f" {machine.name}: mkdir -p ~/.edf && cp {path} ~/.edf/"
        )
    try:
        return edf.read(path), note
    except edf.EDFError as exc:
        raise ConfigError(str(exc)) from None


def local_cpus_per_task(node_cpus: int, tasks_per_node: int) -> int:
    return max(1, node_cpus // tasks_per_node)


def substitute(
    params: dict[str, Any], rehearsal: Rehearsal, machine: MachineProfile, tasks_per_node: int
) -> dict[str, Any]:
    """submitit's parameters of the site's script, with the site-only parts substituted."""
    params = dict(params)
    for key in ("gpus_per_node", "gpus_per_task", "constraint", "qos", "account"):
        params.pop(key, None)
    params["partition"] = rehearsal.local.slurm.partition
    cpus = local_cpus_per_task(rehearsal.node_cpus, tasks_per_node)
    params["cpus_per_task"] = cpus
    extra = {
        k: v
        for k, v in params.pop("additional_parameters", {}).items()
        if k not in ("gpu-bind", "network")
    }
    if extra:
        params["additional_parameters"] = extra
    srun = [_local_srun_arg(arg, cpus) for arg in params["srun_args"]]
    srun = [arg for arg in srun if arg]
    if machine.slurm.mpi_default and not _names_mpi(srun):
        srun.append(f"--mpi={machine.slurm.mpi_default}")
    params["srun_args"] = srun
    setup = list(params.get("setup", []))
    if machine.modules or any("module" in line for line in setup):
        setup.insert(0, MODULE_FUNCTION)
    setup += [f"export {k}={shlex.quote(v)}" for k, v in sorted(rehearsal.edf_env.items())]
    params["setup"] = setup
    return params


def _local_srun_arg(arg: str, cpus: int) -> str:
    if arg.startswith(GPU_FLAGS + SLINGSHOT_FLAGS + CONTAINER_FLAGS):
        return ""
    if arg.startswith("--cpus-per-task"):
        return f"--cpus-per-task={cpus}"
    return arg


def _names_mpi(srun_args: list[str]) -> bool:
    return any(arg.startswith("--mpi") for arg in srun_args)


def local_cluster_cpus() -> int:
    """CPUs per node of the running local cluster; ConfigError when it is not running."""
    try:
        name, nodes = SLURM.cluster()
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(
            f"rehearse=true: the local Slurm cluster is not running ({_why(exc)}); start it"
            f" with: bash {START_SCRIPT}"
        ) from None
    cluster = next(
        (ln.split("=", 1)[1].strip() for ln in name.splitlines() if ln.startswith("ClusterName")),
        "",
    )
    if cluster != LOCAL_CLUSTER:
        raise ConfigError(
            f"rehearse=true: this Slurm is cluster {cluster!r}, not the local test cluster"
            f" {LOCAL_CLUSTER!r}; rehearse on a computer running bash {START_SCRIPT}"
        )
    cpus = [int(line.split()[1]) for line in nodes.splitlines() if len(line.split()) == 2]
    if len(cpus) < NODES:
        raise ConfigError(
            f"rehearse=true: the local cluster has {len(cpus)} node(s), a rehearsal needs"
            f" {NODES}; restart it with: bash {START_SCRIPT}"
        )
    return min(cpus)


def _why(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"`{exc.filename}` is not installed"
    if isinstance(exc, subprocess.CalledProcessError):
        text = (exc.stderr or "").strip().splitlines()
        return text[-1] if text else f"exit code {exc.returncode}"
    return str(exc) or type(exc).__name__
