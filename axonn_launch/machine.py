"""Machine profiles as typed data. The values live in ``conf/machine/*.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass(frozen=True)
class SlurmSettings:
    partition: str = ""
    qos: str = ""
    constraint: str = ""
    account: str = ""
    time_min: int = 60
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    gpus_per_task: int = 0
    gpu_bind: str = ""
    network: str = ""
    exclusive: bool = False
    signal_delay_s: int = 120
    srun_args: list[str] = field(default_factory=list)
    extra_sbatch: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Container:
    """The container the tasks run in; ``engine`` empty: none (bare metal or modules)."""

    engine: str = ""  # edf: CSCS Container Engine (srun --environment=<environment>)
    environment: str = ""  # EDF name in ~/.edf, or a path to one
    python: str = ""  # the interpreter inside the container (its venv), never the login node's


@dataclass(frozen=True)
class MachineProfile:
    name: str
    scheduler: str  # local | slurm
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

    def __post_init__(self) -> None:
        if self.container.engine and not (self.python or self.container.python):
            raise ValueError(
                f"machine.container.python: empty for {self.name!r}, which runs in a container"
                f" ({self.container.engine}); name the interpreter inside the container (a venv"
                f" made in it, see machines/{self.name}/README.md), or set machine.python=PATH"
            )

    def task_python(self, login_python: str) -> str:
        """The interpreter of each task: ``machine.python``, else the container's, else the
        login node's own (right only where the tasks see the login node's environment)."""
        return self.python or self.container.python or login_python
