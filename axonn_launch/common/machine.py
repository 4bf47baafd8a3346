"""Machine profiles as typed data. The values live in ``conf/machine/*.yaml``."""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields

# The names ``machine.scheduler`` may take: the built-in schedulers' (scheduler/), and any
# registered later joins (``scheduler.register``), so that a profile naming it loads.
SCHEDULERS = ["local", "slurm"]
# ``slurm.partition`` of a site whose jobs take no --partition (Perlmutter: -C gpu and a QOS):
# said so in the profile, so that a partition left out by mistake is caught (profile_problem)
CLUSTER_DEFAULT = "cluster_default"


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int = 1  # ranks per node (GPUs, GCDs, or CPU processes)
    gpu_model: str = "cpu"
    mem_per_gpu_gb: float = 0.0  # 0 = unknown/unbounded (CPU)
    peak_tflops_per_gpu: float = 0.0  # dense bf16
    intra_node_gbps: float = 0.0  # GB/s per GPU, between GPUs of one node (planner)
    inter_node_gbps: float = 0.0  # GB/s per GPU across nodes (injection / GPUs per node)
    latency_us: float = 5.0  # per collective step (planner)
    memory_gbps: float = 0.0  # GPU memory GB/s, for element-wise kernels (planner); 0 = unknown
    # the planner's measured inputs (cost/perf.py profile_calibration), each cited in sources:
    # a large bf16 GEMM's fraction of peak as measured, [lowest, highest]; empty = not measured
    gemm_efficiency: list[float] = field(default_factory=list)
    # measured bus GB/s per group layout, rows [ranks inside the axis, size 2, 4, 8, >= 16]
    bus_gbps: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not all(0 < e <= 1 for e in self.gemm_efficiency) or len(self.gemm_efficiency) > 2:
            raise ValueError(
                f"machine.hardware.gemm_efficiency={self.gemm_efficiency}: expected [lowest,"
                " highest] fractions of peak in (0, 1], or [] (not measured)"
            )
        if any(len(row) != 5 or min(row) <= 0 for row in self.bus_gbps):
            raise ValueError(
                f"machine.hardware.bus_gbps={self.bus_gbps}: expected rows [ranks inside,"
                " GB/s for 2, 4, 8, >= 16 ranks], all positive"
            )

    @property
    def runs_on_gpu(self) -> bool:
        """Whether ``auto`` dtypes resolve as on a GPU (bf16): the one place this is decided
        on the login node, for the memory model, the step time and the job's cost."""
        return self.gpu_model != "cpu" and self.peak_tflops_per_gpu > 0


@dataclass(frozen=True)
class SlurmSettings:
    partition: str = ""
    qos: str = ""
    constraint: str = ""
    account: str = ""
    # minutes per allocation; None (``auto``): the longest the site's bin allows for the
    # job's node count (``time_bins``)
    time_min: int | None = 60
    # the site's wall-time bins, ascending: [up to this many nodes, at most these minutes]
    time_bins: list[list[int]] = field(default_factory=list)
    # QOS or partitions where the site forbids chained jobs: there the recovery chain is off
    no_chain: list[str] = field(default_factory=list)
    # jobs one user may have queued at once (0: no limit known): a larger sweep is warned of
    max_queued_jobs: int = 0
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    gpus_per_task: int = 0
    gpu_bind: str = ""
    network: str = ""
    exclusive: bool = False
    signal_delay_s: int = 120
    srun_args: list[str] = field(default_factory=list)
    # the site's default srun --mpi plugin (slurm.conf MpiDefault); "" = none. A real script
    # relies on it; a rehearsal (rehearse.py) names it, as the local cluster's default is none
    mpi_default: str = ""
    extra_sbatch: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.partition == CLUSTER_DEFAULT:  # no --partition: the cluster's default
            object.__setattr__(self, "partition", "")

    def limit_min(self, nodes: int) -> int:
        """The job's time limit in minutes: ``time_min``, or with ``auto`` the longest that
        the bin of ``nodes`` allows (the last bin's beyond it)."""
        if self.time_min is not None:
            return self.time_min
        return next((m for up_to, m in self.time_bins if nodes <= up_to), self.time_bins[-1][1])

    def chain_forbidden_by(self) -> str:
        """The QOS or partition on which the site forbids chained jobs ('' if none)."""
        return next((name for name in (self.qos, self.partition) if name in self.no_chain), "")


@dataclass(frozen=True)
class Container:
    """The container the tasks run in; ``engine`` empty: none (bare metal or modules)."""

    engine: str = ""  # edf: CSCS Container Engine (srun --environment=<environment>)
    environment: str = ""  # EDF name in ~/.edf, or a path to one
    python: str = ""  # the interpreter inside the container (its venv), never the login node's


@dataclass(frozen=True)
class Broadcast:
    """Where ``machine.python_broadcast`` puts the tasks' Python environment: before srun,
    the batch script packs it once, sends it to every node's local storage with ``sbcast``
    and the tasks run the copy, so that thousands of ranks do not import torch from a
    parallel filesystem at once (OLCF "highly recommends" it at scale:
    olcf/olcf-user-docs:software/python/sbcast_conda.rst)."""

    min_nodes: int = 0  # with python_broadcast unset (null): on from this many nodes; 0 = off
    dir: str = ""  # node-local storage on every node ({user}: the login user's name)
    constraint: str = ""  # an sbatch constraint that storage needs (Frontier: nvme)


# Restart after a failure, besides reading the checkpoint back (cost/expected_goodput.py): unset
# (None), the detection time plus the start-up model at the job's node count (cost/startup.py);
# a profile or machine.reliability.restart_s= that sets it gives the whole restart instead.
# Filesystem write bandwidth per node of a job when a profile names none: a conservative default
# stated as one, below the fair shares of the three site profiles' filesystems (0.27-1.03 GB/s).
DEFAULT_WRITE_GBPS_PER_NODE = 0.25

# The start-up model's phase shapes (seconds = a + b * f(N), cost/startup.py) and labels
STARTUP_FORMS = ("constant", "linear", "n_log_n", "quadratic")
STARTUP_LABELS = ("measured", "emulated")


@dataclass(frozen=True)
class StartupPhase:
    """One phase of the job's start-up: seconds = a + b * f(N), f by ``form``."""

    form: str = ""  # one of STARTUP_FORMS
    a: float = 0.0
    b: float = 0.0
    broadcast: bool = False  # counted only when the job copies its environment (broadcasts)


@dataclass(frozen=True)
class StartupModel:
    """The start-up phases of a job against its node count, with where their coefficients
    come from: the package's ``conf/startup.yaml``, or a site's own in its profile
    (``reliability.startup``)."""

    phases: dict[str, StartupPhase] = field(default_factory=dict)
    label: str = "measured"  # measured (on the site) or emulated (nodes emulated on one host)
    nodes: list[int] = field(default_factory=list)  # the node counts the fits rest on
    source: str = ""

    def __post_init__(self) -> None:
        where = "machine.reliability.startup"
        if self.label not in STARTUP_LABELS:
            raise ValueError(f"{where}.label={self.label!r}: expected one of"
                             f" {', '.join(STARTUP_LABELS)}")  # fmt: skip
        if not self.nodes or min(self.nodes) < 1:
            raise ValueError(f"{where}.nodes={self.nodes}: expected the node counts the fits"
                             " rest on, each >= 1, e.g. [8, 64, 512]")  # fmt: skip
        if not self.phases:
            raise ValueError(f"{where}.phases: empty; expected each phase's form, a and b")
        for name, phase in self.phases.items():
            _check_phase(f"{where}.phases.{name}", phase)


def _check_phase(where: str, phase: StartupPhase) -> None:
    """A one-line ValueError for a phase's unknown form or unusable coefficient."""
    if phase.form not in STARTUP_FORMS:
        raise ValueError(f"{where}.form={phase.form!r}: expected one of {', '.join(STARTUP_FORMS)}")
    if not math.isfinite(phase.a):
        raise ValueError(f"{where}.a={phase.a}: expected a finite number of seconds")
    if not (math.isfinite(phase.b) and phase.b >= 0):
        raise ValueError(f"{where}.b={phase.b}: expected a finite number >= 0 (seconds per unit"
                         " of the form's f(N); a phase does not shrink as N grows)")  # fmt: skip
    if phase.form == "constant" and phase.b:
        raise ValueError(f"{where}.b={phase.b}: a constant phase has only a (b: 0)")


@dataclass(frozen=True)
class Reliability:
    """How often a node fails and what a checkpoint costs: the inputs of the checkpoint
    interval (``train.checkpoint_every=auto``) and of the predicted goodput
    (``cost/expected_goodput.py``). Site profiles cite each value they set (``sources``)."""

    # mean hours between job-ending failures of one node; 0 = unknown (no prediction, no auto)
    node_mtbf_hours: float = 0.0
    # checkpoint write bandwidth of the shared filesystem per node of the job, GB/s
    write_gbps_per_node: float = DEFAULT_WRITE_GBPS_PER_NODE
    # failure to training again, besides the read-back; None: detection + the start-up model
    restart_s: float | None = None
    # the site's own start-up model; None: the package's (conf/startup.yaml)
    startup: StartupModel | None = None

    def __post_init__(self) -> None:
        for name in ("node_mtbf_hours", "restart_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"machine.reliability.{name}={value}: must be >= 0")
        if not self.write_gbps_per_node > 0:
            raise ValueError(
                f"machine.reliability.write_gbps_per_node={self.write_gbps_per_node}: must be > 0"
                " (GB/s the filesystem takes per node of the job)"
            )


ON_SLOW = ("stop", "warn")
GEMM_DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class PreflightSettings:
    """What the preflight in the allocation (``axonn_launch.train.health.preflight``) expects.

    Floors are fractions of the ``hardware`` numbers, so that each number has one source;
    a zero hardware number (CPU profiles) means no floor, and only the relative rule holds:
    a rank whose GEMM rate is below ``slow_fraction`` of the job's median is slow.
    """

    gemm_size: int = 512  # square GEMM, n x n times n x n
    gemm_dtype: str = "fp32"  # bf16 | fp32
    gemm_floor: float = 0.5  # x hardware.peak_tflops_per_gpu: a rank below it is slow
    slow_fraction: float = 0.5  # x the median rank's GEMM TFLOP/s: a rank below it is slow
    # x hardware.intra_node_gbps / inter_node_gbps: all-reduce bus bandwidth below it warns
    bandwidth_floor: float = 0.5
    allreduce_mib: int = 4  # all-reduce message size
    # regex that NCCL's "Using network NAME" must match on multi-node jobs ("" = any)
    network: str = ""
    on_slow: str = "stop"  # stop: end the job before training; warn: log and train

    def __post_init__(self) -> None:
        if self.on_slow not in ON_SLOW:
            raise ValueError(
                f"machine.preflight.on_slow={self.on_slow!r}: expected one of {', '.join(ON_SLOW)}"
            )
        if self.gemm_dtype not in GEMM_DTYPES:
            raise ValueError(
                f"machine.preflight.gemm_dtype={self.gemm_dtype!r}: expected one of"
                f" {', '.join(GEMM_DTYPES)}"
            )
        for name in ("gemm_size", "allreduce_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"machine.preflight.{name}={getattr(self, name)}: must be >= 1")
        try:
            re.compile(self.network)
        except re.error as exc:
            raise ValueError(
                f"machine.preflight.network={self.network!r}: not a regular expression ({exc})"
            ) from None
        for name in ("gemm_floor", "slow_fraction", "bandwidth_floor"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(
                    f"machine.preflight.{name}={getattr(self, name)}: must be between 0 and 1"
                )


@dataclass(frozen=True)
class PreflightExpectations:
    """The numbers one job's preflight compares with: the profile's rule made concrete.

    Written by the launcher as ``<job_dir>/preflight_expected.json``; 0 = no floor.
    """

    machine: str = ""
    gemm_size: int = 512
    gemm_dtype: str = "fp32"
    gemm_min_tflops: float = 0.0
    slow_fraction: float = 0.5
    intra_node_min_gbps: float = 0.0
    inter_node_min_gbps: float = 0.0
    allreduce_mib: int = 4
    network: str = ""
    on_slow: str = "stop"


@dataclass(frozen=True)
class MachineProfile:
    name: str
    scheduler: str  # one of SCHEDULERS
    backend: str  # gloo | nccl (RCCL answers to nccl in torch)
    hardware: Hardware
    slurm: SlurmSettings
    device_index: str = "local_rank"  # local_rank | zero
    modules: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)  # shell lines run before srun (assets)
    # exported, quoted, in the batch script; multinode_env only when nodes > 1
    env: dict[str, str] = field(default_factory=dict)
    multinode_env: dict[str, str] = field(default_factory=dict)
    # set per task in Python (never by a shell); may use {user} {node_id} {local_rank}
    # {rank} {job_dir}
    task_env: dict[str, str] = field(default_factory=dict)
    container: Container = field(default_factory=Container)
    # the interpreter srun starts in each task; empty: the container's, else the login node's
    python: str = ""
    # keys only the user knows, e.g. slurm.account
    required: list[str] = field(default_factory=list)
    # used when no grid axis is given; without one the planner chooses
    default_grid: dict[str, int] = field(default_factory=dict)
    master_port: int = 29500
    max_local_processes: int = 64  # scheduler=local only
    # scheduler=local only: refuse a run whose ranks' estimated memory exceeds what this
    # computer has available less this share of it (common/hostmem.py); false: no check
    host_memory_check: bool = True
    host_memory_headroom: float = 0.1
    preflight: PreflightSettings = field(default_factory=PreflightSettings)
    # copy the tasks' venv to node-local storage before srun: true, false, or null (auto:
    # from broadcast.min_nodes nodes on)
    python_broadcast: bool | None = None
    broadcast: Broadcast = field(default_factory=Broadcast)
    reliability: Reliability = field(default_factory=Reliability)
    # where each site fact comes from: "env.NAME", "multinode_env.NAME", "task_env.NAME",
    # "slurm.KEY" (a field changed from SlurmSettings' default; "slurm.extra_sbatch.KEY"),
    # "srun_args[ARG]" (ARG as composed, interpolations resolved), "modules", "setup[N]"
    # (1-based), "container.KEY", "broadcast.KEY", "reliability.KEY" -> a URL or
    # owner/repo:path, then any note (tests/config/test_site_sources.py checks that every flag,
    # variable and reliability figure of a site profile has one)
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.container.engine and not (self.python or self.container.python):
            raise ValueError(
                f"machine.container.python: empty for {self.name!r}, which runs in a container"
                f" ({self.container.engine}); name the interpreter inside the container (a venv"
                f" made in it, see machines/{self.name}/README.md), or set machine.python=PATH"
            )

    def preflight_expectations(self) -> PreflightExpectations:
        """The preflight's floors: the profile's fractions times its hardware numbers."""
        rule, hardware = self.preflight, self.hardware
        return PreflightExpectations(
            machine=self.name,
            gemm_size=rule.gemm_size,
            gemm_dtype=rule.gemm_dtype,
            gemm_min_tflops=rule.gemm_floor * hardware.peak_tflops_per_gpu,
            slow_fraction=rule.slow_fraction,
            intra_node_min_gbps=rule.bandwidth_floor * hardware.intra_node_gbps,
            inter_node_min_gbps=rule.bandwidth_floor * hardware.inter_node_gbps,
            allreduce_mib=rule.allreduce_mib,
            network=rule.network,
            on_slow=rule.on_slow,
        )

    def broadcasts(self, nodes: int) -> bool:
        """Whether a job on ``nodes`` nodes runs its tasks from a node-local copy."""
        if self.python_broadcast is not None:
            return self.python_broadcast
        return 0 < self.broadcast.min_nodes <= nodes

    def task_python(self, login_python: str) -> str:
        """The interpreter of each task: ``machine.python``, else the container's, else the
        login node's own (right only where the tasks see the login node's environment)."""
        return self.python or self.container.python or login_python


# --- the profile schema: keys a profile must carry, by what its machine is ---------------------

# (dotted key, why it is needed) for every Slurm machine, then for one with GPUs. A default
# would be silently wrong there: 1 rank per node, no memory check, no --partition.
SLURM_KEYS = (("hardware.gpu_model", "cpu, or the GPU model of a node"),)
SLURM_GPU_KEYS = (
    ("hardware.gpus_per_node", "the ranks per node (GPUs, or GCDs of an MI250X)"),
    ("hardware.mem_per_gpu_gb", "the memory of one GPU, against which a job is checked"),
    ("slurm.partition", f"a partition, or {CLUSTER_DEFAULT} for none (the cluster's default)"),
    ("preflight.network", "the regex NCCL's (RCCL's) 'Using network NAME' must match"),
    # the planner's figures: without them a dry run's summary has no step time to show
    ("hardware.peak_tflops_per_gpu", "the dense bf16 TFLOP/s of one GPU (the planner's)"),
    ("hardware.intra_node_gbps", "GB/s per GPU between the GPUs of a node (the planner's)"),
    ("hardware.inter_node_gbps", "GB/s per GPU across nodes (the planner's)"),
)
# NCCL and RCCL both read NCCL_NET: set, they fail instead of falling back to TCP sockets. A
# container (Alps's Container Engine) sets the network variables in its image instead
NETWORK_KEY = ("multinode_env.NCCL_NET", "the network plugin, e.g. OFI or AWS Libfabric")


def required_keys() -> list[str]:
    """The keys every profile sets: ``MachineProfile``'s fields without a default."""
    return [f.name for f in fields(MachineProfile) if f.default is MISSING
            and f.default_factory is MISSING]  # fmt: skip


def lookup(raw: dict, key: str) -> object:
    """The value at dotted ``key`` of ``raw``, or None where a part is missing or empty."""
    node: object = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return None if node in (None, "") else node


def required_problem(raw: dict) -> str:
    """The first key of every profile that ``raw`` (a profile as plain data) misses, or a
    scheduler no launcher knows, as ``machine.KEY: ...``; ``""`` if none."""
    for key in required_keys():
        if key not in raw or raw[key] is None:
            return f"machine.{key}: missing; every machine profile sets it"
    if raw["scheduler"] not in SCHEDULERS:
        return f"machine.scheduler={raw['scheduler']!r}: expected one of {', '.join(SCHEDULERS)}"
    return ""


def kind_problem(raw: dict) -> str:
    """The first key that what the machine is (``scheduler``, ``hardware.gpu_model``) makes
    necessary and ``raw`` misses, as ``machine.KEY: missing; ...``; ``""`` if none."""
    if raw.get("scheduler") != "slurm":
        return ""
    needed = list(SLURM_KEYS)
    if lookup(raw, "hardware.gpu_model") not in (None, "cpu"):
        needed += SLURM_GPU_KEYS
        needed += [] if lookup(raw, "container.engine") else [NETWORK_KEY]
    for key, why in needed:
        if lookup(raw, key) is None:
            return f"machine.{key}: missing; a {machine_kind(raw)} needs it: {why}"
    return ""


def machine_kind(raw: dict) -> str:
    """``Slurm machine with GPUs (MI250X)`` or ``Slurm machine``, for a message."""
    gpu = lookup(raw, "hardware.gpu_model")
    return f"Slurm machine with GPUs ({gpu})" if gpu not in (None, "cpu") else "Slurm machine"
