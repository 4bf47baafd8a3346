"""Resolve a launch on the login node: check every value, fix the grid, node count,
micro-batch and checkpoint interval, and cost them once (``Resolved``). Everything that
would fail in the queue fails here, in one line.

Whether the model and batch fit the grid is decided by ``common/rules.py``, the same
functions the planner and the job ask.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from axonn_launch import scheduler
from axonn_launch.common import hostmem, prompts, rules, slurmtext, tokenfile
from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import MachineProfile, SlurmSettings
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import GenerateConfig, MemorizationConfig, TrainConfig
from axonn_launch.config import edf
from axonn_launch.config.compose import (
    AUTO_KEYS,
    ConfigError,
    GridRequest,
    LaunchConfig,
    Site,
    account_override,
)
from axonn_launch.config.rehearsal import what_resolves
from axonn_launch.cost.expected_goodput import Checkpointing, predict
from axonn_launch.cost.memory import MemoryEstimate, estimate_memory, fit_micro_batch
from axonn_launch.cost.perf import StepTime, step_time

BUILTIN_DATA = ("shakespeare", "synthetic")
BYTE_VOCAB = 256
_NAME_FORBIDDEN = re.compile(r"[/\x00-\x1f\x7f]")
SBATCH_OPTION = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # submitit writes '_' as '-'


@dataclass(frozen=True)
class Resolved:
    """What the launcher will run, costed once: the concrete grid, node count, the
    micro-batch and cached blocks (in ``train``), the memory estimate and the predicted
    step time. The summary, the record and the batch script read it; nothing recomputes it."""

    grid: Grid
    nodes: int
    tasks_per_node: int
    memory: MemoryEstimate
    # with the micro_batch to run (as given, or chosen: rules.py) and the checkpoint interval
    # (as given, or auto's: cost/expected_goodput.py)
    train: TrainConfig
    cfg: LaunchConfig  # the configuration resolved: the launch's, or a rehearsal's site_config
    step_time: StepTime | None = None  # the planner's prediction (cost/perf.py)
    planned: bool = False
    warnings: list[str] = field(default_factory=list)
    # the interval's expected goodput; None when the machine knows no failure rate
    checkpointing: Checkpointing | None = None


@dataclass(frozen=True)
class Costed:
    """A grid with the train settings to run on it, their memory estimate and step time."""

    grid: Grid
    train: TrainConfig
    memory: MemoryEstimate
    step: StepTime | None


def resolve(cfg: LaunchConfig) -> Resolved:
    """Check ``cfg``, fix the grid, node count, micro-batch and checkpoint interval, and
    cost them once; raises ConfigError. A rehearsal (``cfg.rehearse``) resolves its site's
    configuration (``rehearsal.site_config``), held in ``Resolved.cfg``. A launch calls it
    once (``pipeline.check``)."""
    cfg = what_resolves(cfg)
    check_name(cfg.name)
    check_scheduler_text(cfg)
    check_machine(cfg.machine)
    check_model(cfg.model)
    check_train(cfg.train, cfg.model)
    check_generation(cfg.generate, cfg.memorization, cfg.model, cfg.train.data)
    planned = wants_planner(cfg.grid, cfg.machine)
    costed, (nodes, per_node) = costed_and_placed(cfg, planned)
    grid, memory = costed.grid, costed.memory
    train, checkpointing = choose_checkpoint_every(cfg, nodes, costed.train, costed.step)
    train = with_checkpoint_bandwidth(train, cfg.machine)
    warnings = data_warnings(cfg) + warmup_warnings(cfg.train)
    warnings += missing_user_keys(cfg.machine, dry_run=cfg.dry_run, site=cfg.site)
    warnings += placement_warnings(cfg.machine, grid) + account_warnings(cfg.machine)
    warnings += broadcast_warnings(cfg, nodes)
    warnings += host_memory_warnings(cfg, grid, train, memory) + core_warnings(cfg.machine, grid)
    return Resolved(
        grid=grid,
        nodes=nodes,
        tasks_per_node=per_node,
        memory=memory,
        train=train,
        cfg=cfg,
        step_time=costed.step,
        planned=planned,
        warnings=warnings,
        checkpointing=checkpointing,
    )


def costed_and_placed(cfg: LaunchConfig, planned: bool) -> tuple[Costed, tuple[int, int]]:
    """The grid to run with its costs, and its node count and tasks per node. An explicit
    grid is checked in the order a user fixes it: shape, batch, nodes, then memory."""
    if planned:
        costed = auto_grid(cfg)
        return costed, place(cfg.machine, costed.grid, cfg.nodes)
    grid = explicit_grid(cfg.grid, cfg.machine)
    _fail(rules.shape_problem(cfg.model, grid))
    _fail(rules.batch_problem(cfg.train, grid))
    placed = place(cfg.machine, grid, cfg.nodes)
    return costed_grid(cfg, grid), placed


def costed_grid(cfg: LaunchConfig, grid: Grid) -> Costed:
    """An explicit grid with its micro-batch and cached blocks (given, or chosen), their
    memory estimate and predicted step time."""
    train, memory = choose_micro_batch(cfg.model, grid, cfg.train, cfg.machine)
    if train.cache_layers is None:
        train, memory = choose_cache_layers(cfg.model, grid, train, cfg.machine)
    return Costed(grid, train, memory, predicted_step(cfg, grid, train))


def predicted_step(cfg: LaunchConfig, grid: Grid, train: TrainConfig) -> StepTime | None:
    """The planner's step time for what will run; None where the profile has no figures to
    predict from (no bandwidths: a laptop, a test profile)."""
    try:
        return step_time(hardware=cfg.machine.hardware, model=cfg.model, train=train, grid=grid)
    except ValueError:
        return None


def check_name(name: str) -> None:
    if not name or len(name) > 128 or _NAME_FORBIDDEN.search(name) or name in (".", ".."):
        raise ConfigError(
            f"name={name!r}: must be 1-128 characters without '/' or control characters"
        )


def scheduler_text(cfg: LaunchConfig) -> Iterator[tuple[str, str]]:
    """(key, value) of every config value the launcher writes into a batch script's
    ``#SBATCH`` lines, its srun line or the recovery job's script; ``site.accounts``
    first, which becomes ``machine.slurm.account``."""
    machine, slurm = cfg.machine, cfg.machine.slurm
    for name, account in cfg.site.accounts.items():
        yield f"site.accounts.{name}", str(account)
    for key in ("partition", "qos", "constraint", "account", "gpu_bind", "network", "mpi_default"):
        yield f"machine.slurm.{key}", str(getattr(slurm, key))
    for key, value in slurm.extra_sbatch.items():
        yield f"machine.slurm.extra_sbatch.{key}", str(value)
    for n, arg in enumerate(slurm.srun_args):
        yield f"machine.slurm.srun_args[{n}]", str(arg)
    for n, module in enumerate(machine.modules):
        yield f"machine.modules[{n}]", str(module)
    for key in ("python", "container.python", "container.environment", "broadcast.dir",
                "broadcast.constraint"):  # fmt: skip
        yield f"machine.{key}", str(_lookup(machine, key))


def check_scheduler_text(cfg: LaunchConfig) -> None:
    """No control character in what reaches a batch script: a newline in a partition
    would end its ``#SBATCH`` line there, make the rest a shell line, and end the
    ``#SBATCH`` block."""
    for key, value in scheduler_text(cfg):
        found = slurmtext.control_characters(value)
        if found:
            raise ConfigError(
                f"{key}={value!r}: holds control characters ({found}); valid: text on one line"
            )
    for key in cfg.machine.slurm.extra_sbatch:
        if not SBATCH_OPTION.fullmatch(key):
            raise ConfigError(
                f"machine.slurm.extra_sbatch.{key}: not an sbatch option name; valid: letters,"
                " digits, '-' and '_', e.g. mail-type"
            )


def check_job_dir(job_dir: str, machine: MachineProfile) -> None:
    """The job dir (``hydra.run.dir``) goes into the batch script and Slurm's log paths:
    no control characters anywhere, and on Slurm none of submitit's placeholders (it
    would replace ``%j`` in the dir's own name too) nor a backslash (which turns off
    Slurm's ``%j`` in a log path). Any other ``%`` is escaped (``render.escape_log_paths``)."""
    key = f"hydra.run.dir={job_dir!r}"
    found = slurmtext.control_characters(job_dir)
    if found:
        raise ConfigError(f"{key}: holds control characters ({found}); valid: a one-line path")
    if not scheduler.of(machine).queued:
        return
    tags = [tag for tag in slurmtext.SUBMITIT_TAGS if tag in job_dir]
    if tags:
        raise ConfigError(
            f"{key}: holds {', '.join(tags)}, which submitit replaces in its folder (the job"
            " id, task or array index) wherever they appear; valid: a path without them"
        )
    if "\\" in job_dir:
        raise ConfigError(
            f"{key}: holds a backslash, which turns off Slurm's %j in the log paths;"
            " valid: a path without one"
        )


def check_machine(machine: MachineProfile) -> None:
    _one_of("machine.scheduler", machine.scheduler, scheduler.names())
    _one_of("machine.backend", machine.backend, ("auto", "gloo", "nccl"))
    _one_of("machine.device_index", machine.device_index, ("local_rank", "zero"))
    _positive("machine.hardware.gpus_per_node", machine.hardware.gpus_per_node)
    if not 0 <= machine.host_memory_headroom < 1:
        raise ConfigError(
            f"machine.host_memory_headroom={machine.host_memory_headroom}: must be >= 0 and < 1"
            " (the share of the available memory left free)"
        )
    if scheduler.of(machine).queued:
        check_time_limit(machine.slurm)
        _positive("machine.slurm.cpus_per_task", machine.slurm.cpus_per_task)
    for key in machine.env | machine.multinode_env | machine.task_env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"machine.env.{key}: not a valid environment variable name")


def check_model(model: ModelSpec) -> None:
    for key in ("n_layer", "d_model", "n_head", "vocab_size", "max_seq_len", "ffn_mult"):
        _positive(f"model.{key}", getattr(model, key))
    _fail(rules.model_problem(model))


def check_train(train: TrainConfig, model: ModelSpec) -> None:
    for key in ("steps", "global_batch", "seq_len", "log_every"):
        _positive(f"train.{key}", getattr(train, key))
    if train.micro_batch is not None:  # None: automatic
        _positive("train.micro_batch", train.micro_batch)
    for key in ("lr", "beta1", "beta2"):
        if not getattr(train, key) > 0:
            raise ConfigError(f"train.{key}={getattr(train, key)}: must be > 0")
    for key in ("min_lr", "weight_decay", "grad_clip", "warmup_steps", "log_every_s",
                "threads", "emulate_host_ranks", "emulate_step_s"):  # fmt: skip
        _non_negative(f"train.{key}", getattr(train, key))
    check_checkpoint_every(train.checkpoint_every)
    if train.min_lr > train.lr:
        raise ConfigError(f"train.min_lr={train.min_lr}: must not exceed train.lr={train.lr}")
    _one_of("train.schedule", train.schedule, ("cosine", "constant"))
    _one_of("train.dtype", train.dtype, ("auto", "fp32", "bf16"))
    _fail(rules.seq_len_problem(model, train))
    _fail(rules.throughput_problem(model, train))
    check_data(train.data, model)


def check_checkpoint_every(every: int | None) -> None:
    """A number of steps >= 0, or None (``auto``)."""
    key = "train.checkpoint_every"
    if every is not None and every < 0:
        raise ConfigError(f"{key}={every}: expected {AUTO_KEYS[key]}")


def check_generation(
    generate: GenerateConfig, memorization: MemorizationConfig, model: ModelSpec, data: str
) -> None:
    """A generation job (generate.prompts) and the in-job memorization measurement
    (memorization.data): what their generation would reject, the longest prompt included
    (``data``: train.data, whose bytes are the text of a model trained on the corpus)."""
    if generate.prompts:
        _fail(rules.new_tokens_problem("generate.max_new_tokens", generate.max_new_tokens, model))
        _positive("generate.batch_size", generate.batch_size)
        for key in ("temperature", "top_k"):
            _non_negative(f"generate.{key}", getattr(generate, key))
        _fail(prompts.too_long_prompt(generate, model, data))
    if memorization.data:
        _fail(
            rules.new_tokens_problem("memorization.continuation", memorization.continuation, model)
        )
        _positive("memorization.max_documents", memorization.max_documents)
        _positive("memorization.batch_size", memorization.batch_size)


def check_data(data: str, model: ModelSpec) -> None:
    if data == "shakespeare" and model.vocab_size < BYTE_VOCAB:
        raise ConfigError(
            f"train.data=shakespeare: byte tokens need model.vocab_size >= {BYTE_VOCAB}"
            f" (got {model.vocab_size})"
        )
    if data not in BUILTIN_DATA and os.path.exists(data):  # a missing one: data_warnings
        _fail(tokenfile.problem("train.data", data, model.vocab_size))
        if os.path.exists(os.path.splitext(data)[0] + ".idx"):  # numpy only when needed
            from axonn_launch.common.indexed import index_file_problem

            _fail(index_file_problem("train.data", data))


BIG_MODEL_PARAMS = 1e9  # from here on, the built-in corpus is only a smoke test


def data_warnings(cfg: LaunchConfig) -> list[str]:
    """A token file missing here fails a real submission and warns in a dry run (it may
    exist on the cluster); a model of 1B parameters or more on the built-in corpus warns."""
    data, params = cfg.train.data, cfg.model.n_params()
    if data not in BUILTIN_DATA and not os.path.exists(data):
        message = (
            f"train.data={data!r}: no such file here; valid: shakespeare, synthetic,"
            " or a path to a .bin token file"
        )
        if not cfg.dry_run:
            raise ConfigError(message)
        return [f"{message} (a real submission checks it again)"]
    if data == "shakespeare" and params >= BIG_MODEL_PARAMS:
        return [
            f"model={cfg.model.name} ({params / 1e9:.1f} B parameters) on train.data=shakespeare,"
            " the built-in 1 MB corpus: fine for a smoke test, not for training; pass"
            " train.data=<path to a .bin token file>"
        ]
    return []


def wants_planner(request: GridRequest, machine: MachineProfile) -> bool:
    """grid=auto, or no grid at all on a machine without a default grid."""
    if request.auto and request.given():
        raise ConfigError("grid=auto: do not also set grid.data/x/y/z")
    if request.pick and not request.auto:
        raise ConfigError(f"grid.pick={request.pick}: only with grid=auto")
    return request.auto or (not request.given() and not machine.default_grid)


def auto_grid(cfg: LaunchConfig) -> Costed:
    """The planner's fastest grid on ``nodes``, or on the fewest nodes where any grid fits
    (``planner.smallest_nodes``, as ``plan`` without nodes=), with the micro-batch and
    cached blocks it chose and its costs, taken from its row as they are; ``grid.pick=k``
    takes its (k+1)-th best."""
    from axonn_launch.cost import planner

    pick = cfg.grid.pick
    if pick < 0:
        raise ConfigError(f"grid.pick={pick}: must be 0 (the best) or more")
    machine, model, train = cfg.machine, cfg.model, cfg.train
    try:
        nodes = 1 if scheduler.of(machine).on_this_computer else cfg.nodes
        if nodes is None:
            nodes = planner.smallest_nodes(machine=machine, model=model, train=train)
        rows = planner.plan(machine=machine, model=model, train=train, nodes=nodes, top=pick + 1)
        if not rows:
            raise planner.PlanError(
                planner.why_nothing_fits(machine=machine, model=model, train=train, nodes=nodes)
            )
    except planner.PlanError as exc:
        raise ConfigError(f"grid=auto: {exc}") from exc
    if len(rows) <= pick:
        raise ConfigError(
            f"grid.pick={pick}: the planner found {len(rows)} runnable grid(s) on {nodes}"
            f" node(s); valid: grid.pick=0..{len(rows) - 1}"
        )
    row = rows[pick]
    chosen = replace(train, micro_batch=row.micro_batch, cache_layers=row.cache_layers)
    return Costed(row.grid, chosen, row.memory, row.step)


def explicit_grid(request: GridRequest, machine: MachineProfile) -> Grid:
    axes = {a: getattr(request, a) for a in ("data", "x", "y", "z")}
    if not request.given():
        axes = dict(machine.default_grid)
    try:
        return Grid(**{a: (1 if v is None else v) for a, v in axes.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


def place(machine: MachineProfile, grid: Grid, nodes: int | None) -> tuple[int, int]:
    """Node count and tasks per node for ``grid`` on ``machine``."""
    world = grid.world_size
    if scheduler.of(machine).on_this_computer:
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


def choose_micro_batch(
    model: ModelSpec, grid: Grid, train: TrainConfig, machine: MachineProfile
) -> tuple[TrainConfig, MemoryEstimate]:
    """``train`` with the micro-batch to run (given, or the largest that fits) and its
    memory estimate; raises ConfigError when it does not fit."""
    chosen = fit_micro_batch(model, grid, train, machine.hardware)
    if isinstance(chosen, str):
        raise ConfigError(chosen)
    micro, memory = chosen
    return replace(train, micro_batch=micro), memory


def choose_cache_layers(
    model: ModelSpec, grid: Grid, train: TrainConfig, machine: MachineProfile
) -> tuple[TrainConfig, MemoryEstimate]:
    """``train.cache_layers=null`` on an explicit grid: the planner's choice for it."""
    from axonn_launch.cost import planner

    cache = planner.resolve_cache_layers(machine.hardware, model, train, grid)
    train = replace(train, cache_layers=cache)
    gpu = machine.hardware.runs_on_gpu
    return train, estimate_memory(model=model, grid=grid, train=train, on_gpu=gpu)


def choose_checkpoint_every(
    cfg: LaunchConfig, nodes: int, train: TrainConfig, step: StepTime | None
) -> tuple[TrainConfig, Checkpointing | None]:
    """``train`` with the checkpoint interval to run (``auto``: Daly's interval over the
    predicted step time, ``cost/expected_goodput.py``) and that interval's expected goodput; no
    prediction (None) where the machine knows no failure rate or step time, and then
    ``auto`` is an error."""
    machine, model, every = cfg.machine, cfg.model, train.checkpoint_every
    auto = "train.checkpoint_every=auto"
    if machine.reliability.node_mtbf_hours <= 0:
        if every is None:
            raise ConfigError(
                f"{auto}: machine={machine.name} knows no failure rate"
                " (machine.reliability.node_mtbf_hours=0); set machine.reliability.node_mtbf_hours="
                "<mean hours between failures of one node>, or train.checkpoint_every=<steps>"
            )
        return train, None
    if step is None:  # a profile without the numbers the step time needs
        if every is None:
            raise ConfigError(
                f"{auto}: no predicted step time to count the interval in"
                " (machine.hardware has no bandwidth figures)"
            )
        return train, None
    checkpointing = predict(
        machine=machine,
        model=model,
        nodes=nodes,
        step_s=step.total,
        steps=train.steps,
        every=every,
    )
    return replace(train, checkpoint_every=checkpointing.every), checkpointing


def with_checkpoint_bandwidth(train: TrainConfig, machine: MachineProfile) -> TrainConfig:
    """The watchdog's save deadline counts a save's bytes at the machine's file system
    share per node unless ``train.watchdog.checkpoint_gbps`` says otherwise."""
    if train.watchdog.checkpoint_gbps > 0:
        return train
    gbps = machine.reliability.write_gbps_per_node
    return replace(train, watchdog=replace(train.watchdog, checkpoint_gbps=gbps))


def container_warnings(cfg: LaunchConfig, job_dir: str) -> list[str]:
    """A container machine's EDF must exist and mount the job dir, or no task can see it:
    an error for a real submission, a warning for a dry run (the EDF may live on the
    cluster only). A rehearsal checks the EDF itself (``rehearse.prepare``)."""
    machine = cfg.machine
    if machine.container.engine != "edf" or cfg.rehearse:
        return []
    try:
        found = edf.load(machine.container.environment)
    except edf.EDFError as exc:
        problem = str(exc)
    else:
        if found.covers(job_dir):
            return []
        problem = (
            f"job dir {job_dir}: outside the mounts of the {machine.name} container"
            f" ({found.mount_list()}), so no task could see it; launch from under one of"
            " them or set hydra.run.dir=<a path under one of them>"
        )
    if not cfg.dry_run:
        raise ConfigError(problem)
    return [f"{problem} (a real submission stops here)"]


def warmup_warnings(train: TrainConfig) -> list[str]:
    """A run whose warm-up outlasts it never reaches ``train.lr`` (train/loop.py
    learning_rate): a warning, with a warm-up that fits."""
    steps = train.steps - train.schedule_start  # an extension warms up again from its start
    if train.warmup_steps < steps:
        return []
    return [
        f"train.warmup_steps={train.warmup_steps} >= the run's {steps} steps"
        f" (train.steps={train.steps}): the learning rate never leaves its warm-up to reach"
        f" train.lr; pass e.g. train.warmup_steps={max(1, steps // 10)}"
    ]


def missing_user_keys(
    machine: MachineProfile, *, dry_run: bool, site: Site | None = None
) -> list[str]:
    """Keys only the user knows; an error for a real submission, a warning for a dry run."""
    missing = [key for key in machine.required if not _lookup(machine, key)]
    hint = account_override(site or Site(), machine.name)
    messages = [
        f"machine.{key} is not set; pass machine.{key}=... or {hint}=... (or put it in"
        " conf/local/default.yaml)"
        for key in missing
    ]
    if messages and not dry_run:
        raise ConfigError(messages[0])
    return messages


def broadcast_warnings(cfg: LaunchConfig, nodes: int) -> list[str]:
    """``machine.python_broadcast`` copies the environment of the tasks' interpreter: that
    must be a venv or conda env, on a machine without a container. Not knowable here for a
    dry run (the interpreter may live on the cluster): a warning then."""
    machine = cfg.machine
    if not scheduler.of(machine).queued or not machine.broadcasts(nodes):
        return []
    key = "machine.python_broadcast"
    if machine.container.engine:
        raise ConfigError(
            f"{key}=true: {machine.name}'s tasks run in a container, which brings the"
            " environment to every node; set machine.python_broadcast=false"
        )
    if not machine.broadcast.dir:
        raise ConfigError(
            f"machine.broadcast.dir is empty: {key} needs the node-local storage to copy to,"
            " e.g. machine.broadcast.dir=/tmp"
        )
    python = machine.task_python(sys.executable)
    root = os.path.dirname(os.path.dirname(python))
    if any(os.path.exists(os.path.join(root, m)) for m in ("pyvenv.cfg", "conda-meta")):
        return []
    why = "on" if machine.python_broadcast else f"on from {machine.broadcast.min_nodes} nodes"
    problem = (
        f"{key} ({why}): the tasks' interpreter {python} is not in a venv or conda env"
        f" (no pyvenv.cfg or conda-meta in {root}), so there is nothing to copy; make a venv"
        f" (machines/{machine.name}/README.md) or set {key}=false"
    )
    if not cfg.dry_run:
        raise ConfigError(problem)
    return [f"{problem} (a real submission stops here)"]


def placement_warnings(machine: MachineProfile, grid: Grid) -> list[str]:
    """An x that does not divide a node's GPUs runs, but its groups span nodes: the two
    all-reduces per layer over x then cross the slower network (``rules.placement_problem``)."""
    why = rules.placement_problem(machine.hardware, grid) if scheduler.of(machine).queued else None
    if not why:
        return []
    hw = machine.hardware
    return [
        f"{why}: x groups span nodes, so x's all-reduces (two per layer) cross the network"
        f" ({hw.inter_node_gbps:g} GB/s per GPU, {hw.intra_node_gbps:g} inside a node) and each"
        f" step is slower; an x dividing {hw.gpus_per_node} (the rest on y or z) or grid=auto"
        " keeps x inside a node"
    ]


# What a generation job does not hold: it keeps no gradients, optimizer state or
# weight-gradient buffers (the estimate's other terms stand as an upper bound).
TRAINING_ONLY_TERMS = ("gradients", "optimizer", "reduce-scatter buffers")
RANKS_PER_CORE = 2  # beyond this many ranks per core, machine=local warns


def host_memory_warnings(
    cfg: LaunchConfig, grid: Grid, train: TrainConfig, memory: MemoryEstimate
) -> list[str]:
    """machine=local with CPU ranks: the ranks' estimated memory against what this computer
    has available (``hostmem.available``) less ``machine.host_memory_headroom`` of it. Too
    much is an error for a real run, which would thrash until the kernel's OOM killer
    ends it, and a warning for a dry run (nothing starts)."""
    machine = cfg.machine
    cpu_ranks = scheduler.of(machine).on_this_computer and not machine.hardware.runs_on_gpu
    if not cpu_ranks or not machine.host_memory_check:
        return []
    room = hostmem.available()
    if room is None:  # no /proc here: nothing to compare with
        return []
    training = not cfg.generate.prompts
    per_rank = sum(v for k, v in memory.terms.items() if training or k not in TRAINING_ONLY_TERMS)
    need, budget = per_rank * grid.world_size, room.bytes * (1 - machine.host_memory_headroom)
    if need <= budget:
        return []
    gib = hostmem.GIB
    problem = (
        f"machine=local: {grid.world_size} ranks x {per_rank / gib:.2f} GiB (the estimate per"
        f" rank of model={cfg.model.name}) = {need / gib:.1f} GiB exceed the {budget / gib:.1f}"
        f" GiB this computer can give ({room.source}: {room.bytes / gib:.1f} GiB, less"
        f" machine.host_memory_headroom={machine.host_memory_headroom:g}); use"
        f" {rules.or_list(host_memory_remedies(grid, train))}, or machine.host_memory_check=false"
        " to start it anyway"
    )
    if not cfg.dry_run:
        raise ConfigError(problem)
    return [f"{problem} (a real run stops here)"]


def host_memory_remedies(grid: Grid, train: TrainConfig) -> list[str]:
    """What lowers the ranks' total: fewer replicas, a smaller model, fewer tokens per rank."""
    if grid.data > 1:
        remedies = [f"fewer ranks (grid.data={grid.data}: each replica holds the whole model)"]
    else:
        remedies = ["fewer ranks"]
    remedies.append("a smaller model")
    if (train.micro_batch or 0) > 1:
        remedies.append(f"a smaller train.micro_batch (now {train.micro_batch})")
    if not train.activation_checkpointing:
        remedies.append("train.activation_checkpointing=true")
    return remedies


def core_warnings(machine: MachineProfile, grid: Grid) -> list[str]:
    """machine=local: more than RANKS_PER_CORE ranks per core share the cores so thinly
    that each step waits on descheduled peers at every collective."""
    cores = hostmem.cores()
    if not scheduler.of(machine).on_this_computer or grid.world_size <= RANKS_PER_CORE * cores:
        return []
    return [
        f"grid ({grid.describe()}): {grid.world_size} ranks on {cores} core(s) of this computer"
        f" (machine=local): more than {RANKS_PER_CORE} per core, so every step waits for ranks"
        f" that are not running; a grid of at most {RANKS_PER_CORE * cores} ranks is faster"
    ]


# The suffix a machine's GPU accounts end in. NERSC charges a Perlmutter GPU job to the
# project's GPU allocation, whose Slurm account is the project name plus "_g" (docs.nersc.gov,
# "Running jobs" on Perlmutter; e.g. `-A m3239_g` in ImpactX's Perlmutter guide,
# github.com/ECP-WarpX/impactx docs/source/install/hpc/perlmutter.rst).
GPU_ACCOUNT_SUFFIX = {"perlmutter": "_g"}


def account_warnings(machine: MachineProfile) -> list[str]:
    suffix, account = GPU_ACCOUNT_SUFFIX.get(machine.name), machine.slurm.account
    if not suffix or not account or account.endswith(suffix) or account.startswith("<"):
        return []
    return [
        f"machine.slurm.account={account!r} (site.accounts.{machine.name}): GPU jobs on"
        f" {machine.name} are charged to an account ending in {suffix!r}, the project's GPU"
        f" allocation; did you mean {account + suffix!r}?"
    ]


def placeholder(key: str) -> str:
    return f"<REQUIRED:machine.{key}>"


def _lookup(obj: object, dotted: str) -> object:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def _fail(problem: str | None) -> None:
    if problem:
        raise ConfigError(problem)


def check_time_limit(slurm: SlurmSettings) -> None:
    """``time_min`` is minutes, or ``auto`` over bins of ascending node counts."""
    bins = slurm.time_bins
    for i, pair in enumerate(bins):
        ascending = i == 0 or (len(bins[i - 1]) == 2 and pair[0] > bins[i - 1][0])
        if len(pair) != 2 or min(pair) < 1 or not ascending:
            raise ConfigError(
                f"machine.slurm.time_bins[{i}]={pair}: expected [nodes, minutes], both >= 1,"
                " with the node counts ascending"
            )
    if slurm.time_min is None and not bins:
        raise ConfigError(
            "machine.slurm.time_min=auto: this profile has no slurm.time_bins; give minutes"
        )
    if slurm.time_min is not None:
        _positive("machine.slurm.time_min", slurm.time_min)


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key}={value}: must be a positive integer")


def _non_negative(key: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{key}={value}: must be >= 0")


def _one_of(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r}: valid values are {', '.join(valid)}")
