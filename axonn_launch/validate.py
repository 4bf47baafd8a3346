"""Login-node checks: everything that would fail in the queue fails here, in one line."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace

from axonn_launch.config import ConfigError, GridRequest, LaunchConfig
from axonn_launch.grid import Grid
from axonn_launch.machine import MachineProfile
from axonn_launch.memory import GIB, MemoryEstimate, estimate_memory
from axonn_launch.models import ModelSpec
from axonn_launch.spec import TrainConfig

BUILTIN_DATA = ("shakespeare", "synthetic")
BYTE_VOCAB = 256
_NAME_FORBIDDEN = re.compile(r"[/\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Resolved:
    """What the launcher will run: the concrete grid, node count and estimates."""

    grid: Grid
    nodes: int
    tasks_per_node: int
    memory: MemoryEstimate
    train: TrainConfig  # as given, or with the planner's micro_batch under grid=auto
    planned: bool = False
    warnings: list[str] = field(default_factory=list)


def resolve(cfg: LaunchConfig) -> Resolved:
    """Validate ``cfg`` and fix the grid and node count; raises ConfigError."""
    check_name(cfg.name)
    check_machine(cfg.machine)
    check_model(cfg.model)
    check_train(cfg.train, cfg.model)
    planned = wants_planner(cfg)
    grid, train = auto_grid(cfg) if planned else (explicit_grid(cfg), cfg.train)
    check_model_fits_grid(cfg.model, grid)
    check_batch_fits_grid(train, grid)
    nodes, per_node = place(cfg.machine, grid, cfg.nodes)
    memory = check_memory(cfg, grid, train)
    warnings = missing_user_keys(cfg)
    return Resolved(
        grid=grid,
        nodes=nodes,
        tasks_per_node=per_node,
        memory=memory,
        train=train,
        planned=planned,
        warnings=warnings,
    )


def check_name(name: str) -> None:
    if not name or len(name) > 128 or _NAME_FORBIDDEN.search(name) or name in (".", ".."):
        raise ConfigError(
            f"name={name!r}: must be 1-128 characters without '/' or control characters"
        )


def check_machine(machine: MachineProfile) -> None:
    _one_of("machine.scheduler", machine.scheduler, ("local", "slurm"))
    _one_of("machine.backend", machine.backend, ("auto", "gloo", "nccl"))
    _one_of("machine.device_index", machine.device_index, ("local_rank", "zero"))
    _positive("machine.hardware.gpus_per_node", machine.hardware.gpus_per_node)
    if machine.scheduler == "slurm":
        _positive("machine.slurm.time_min", machine.slurm.time_min)
        _positive("machine.slurm.cpus_per_task", machine.slurm.cpus_per_task)
    for key in machine.env | machine.multinode_env | machine.task_env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"machine.env.{key}: not a valid environment variable name")


def check_model(model: ModelSpec) -> None:
    for key in ("n_layer", "d_model", "n_head", "vocab_size", "max_seq_len", "ffn_mult"):
        _positive(f"model.{key}", getattr(model, key))
    if model.d_model % model.n_head:
        raise ConfigError(
            f"model.d_model={model.d_model}: must be divisible by model.n_head={model.n_head}"
        )


def check_train(train: TrainConfig, model: ModelSpec) -> None:
    for key in ("steps", "global_batch", "micro_batch", "seq_len", "log_every"):
        _positive(f"train.{key}", getattr(train, key))
    for key in ("lr", "beta1", "beta2"):
        if not getattr(train, key) > 0:
            raise ConfigError(f"train.{key}={getattr(train, key)}: must be > 0")
    for key in ("min_lr", "weight_decay", "grad_clip", "warmup_steps", "checkpoint_every"):
        if getattr(train, key) < 0:
            raise ConfigError(f"train.{key}={getattr(train, key)}: must be >= 0")
    if train.min_lr > train.lr:
        raise ConfigError(f"train.min_lr={train.min_lr}: must not exceed train.lr={train.lr}")
    _one_of("train.schedule", train.schedule, ("cosine", "constant"))
    _one_of("train.dtype", train.dtype, ("auto", "fp32", "bf16"))
    if train.seq_len > model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={train.seq_len}: must be <= model.max_seq_len={model.max_seq_len}"
        )
    check_data(train.data, model)


def check_data(data: str, model: ModelSpec) -> None:
    if data == "shakespeare" and model.vocab_size < BYTE_VOCAB:
        raise ConfigError(
            f"train.data=shakespeare: byte tokens need model.vocab_size >= {BYTE_VOCAB}"
            f" (got {model.vocab_size})"
        )
    if data not in BUILTIN_DATA and not os.path.isfile(data):
        raise ConfigError(
            f"train.data={data!r}: no such file; valid: shakespeare, synthetic,"
            " or a path to a .bin token file"
        )


def wants_planner(cfg: LaunchConfig) -> bool:
    """grid=auto, or no grid at all on a machine without a default grid."""
    request: GridRequest = cfg.grid
    if request.auto and request.given():
        raise ConfigError("grid=auto: do not also set grid.data/x/y/z")
    if request.pick and not request.auto:
        raise ConfigError(f"grid.pick={request.pick}: only with grid=auto")
    return request.auto or (not request.given() and not cfg.machine.default_grid)


# Node counts tried, smallest first, when grid=auto is given no node count.
AUTO_NODE_COUNTS = tuple(2**k for k in range(15))


def auto_grid(cfg: LaunchConfig) -> tuple[Grid, TrainConfig]:
    """The planner's fastest grid (and its micro-batch) on ``nodes``, or on the smallest
    power-of-two node count where any grid fits; ``grid.pick=k`` takes its (k+1)-th best."""
    from axonn_launch import plan  # the planner, only when asked for

    pick = cfg.grid.pick
    if pick < 0:
        raise ConfigError(f"grid.pick={pick}: must be 0 (the best) or more")
    counts = [cfg.nodes] if cfg.nodes else list(AUTO_NODE_COUNTS)
    if cfg.machine.scheduler == "local":
        counts = [1]
    error: Exception | None = None
    for nodes in counts:
        try:
            rows = plan.plan(
                machine=cfg.machine, model=cfg.model, train=cfg.train, nodes=nodes, top=pick + 1
            )
        except plan.PlanError as exc:
            error = exc
            continue
        if len(rows) > pick:
            row = rows[pick]
            return row.grid, replace(cfg.train, micro_batch=row.micro_batch)
        error = plan.PlanError(
            f"grid.pick={pick}: the planner found {len(rows)} runnable grid(s) on {nodes} nodes"
        )
        if rows:
            break
    raise ConfigError(f"grid=auto: {error}")


def explicit_grid(cfg: LaunchConfig) -> Grid:
    request: GridRequest = cfg.grid
    axes = {a: getattr(request, a) for a in ("data", "x", "y", "z")}
    if not request.given():
        axes = dict(cfg.machine.default_grid)
    try:
        return Grid(**{a: (1 if v is None else v) for a, v in axes.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


def check_model_fits_grid(model: ModelSpec, grid: Grid) -> None:
    """Divisibility the tensor-parallel layers need (heads over y, hidden over x and y)."""
    if model.n_head % grid.y:
        raise ConfigError(
            f"grid.y={grid.y}: must divide model.n_head={model.n_head} (heads are split over y);"
            f" valid y: {_divisors(model.n_head)}"
        )
    if model.d_model % (grid.x * grid.y):
        raise ConfigError(
            f"grid.x*grid.y={grid.x * grid.y}: must divide model.d_model={model.d_model}"
        )
    block = (model.d_model // grid.x) * (model.d_model // grid.y)
    if block % grid.z:
        raise ConfigError(
            f"grid.z={grid.z}: must divide the weight block of {block} elements per x*y shard"
        )


def check_batch_fits_grid(train: TrainConfig, grid: Grid) -> None:
    if train.micro_batch % grid.z:
        raise ConfigError(
            f"train.micro_batch={train.micro_batch}: must be divisible by grid.z={grid.z}"
            " (each z rank takes micro_batch/z sequences)"
        )
    step = train.micro_batch * grid.data
    if train.global_batch % step:
        raise ConfigError(
            f"train.global_batch={train.global_batch}: must be a multiple of"
            f" train.micro_batch*grid.data={step}"
        )


def place(machine: MachineProfile, grid: Grid, nodes: int | None) -> tuple[int, int]:
    """Node count and tasks per node for ``grid`` on ``machine``."""
    world = grid.world_size
    if machine.scheduler == "local":
        if world > machine.max_local_processes:
            raise ConfigError(
                f"grid: {world} ranks exceed machine.max_local_processes="
                f"{machine.max_local_processes} on machine=local"
            )
        if nodes not in (None, 1):
            raise ConfigError(f"nodes={nodes}: machine=local has exactly 1 node")
        return 1, world
    per_node = machine.hardware.gpus_per_node
    if world % per_node:
        raise ConfigError(
            f"grid: world size {world} ({grid.describe()}) is not a whole number of"
            f" {machine.name} nodes of {per_node} GPUs; use a multiple of {per_node}"
        )
    needed = world // per_node
    if nodes is not None and nodes != needed:
        raise ConfigError(
            f"nodes={nodes}: the grid ({grid.describe()}) needs {needed} nodes of {per_node} GPUs"
        )
    return needed, per_node


def check_memory(cfg: LaunchConfig, grid: Grid, train: TrainConfig) -> MemoryEstimate:
    estimate = estimate_memory(model=cfg.model, grid=grid, train=train)
    limit = cfg.machine.hardware.mem_per_gpu_gb
    if limit and estimate.total > limit * GIB:
        name, value = estimate.biggest()
        raise ConfigError(
            f"grid ({grid.describe()}): needs {estimate.total / GIB:.1f} GiB per GPU but"
            f" {cfg.machine.name} has {limit:g} GiB (largest term: {name} {value / GIB:.1f} GiB);"
            " use more z/x/y ranks, a smaller micro_batch or train.activation_checkpointing=true"
        )
    return estimate


def missing_user_keys(cfg: LaunchConfig) -> list[str]:
    """Keys only the user knows; an error for a real submission, a warning for a dry run."""
    missing = [key for key in cfg.machine.required if not _lookup(cfg.machine, key)]
    hint = f"site.accounts.{cfg.machine.name}"
    messages = [
        f"machine.{key} is not set; pass machine.{key}=... or {hint}=... (or put it in"
        " conf/local/default.yaml)"
        for key in missing
    ]
    if messages and not cfg.dry_run:
        raise ConfigError(messages[0])
    return messages


def placeholder(key: str) -> str:
    return f"<REQUIRED:machine.{key}>"


def _lookup(obj: object, dotted: str) -> object:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key}={value}: must be a positive integer")


def _one_of(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r}: valid values are {', '.join(valid)}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
