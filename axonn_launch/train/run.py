"""The training job of one rank (``run_job``), in the order it runs.

``run_job(spec)`` is the whole training job of one rank: bootstrap, process groups, model,
data, resume from the latest checkpoint if any, the optimizer loop, an optional sample,
and a summary (also written to ``<job_dir>/summary.json`` by rank 0). Its parts live in
the folders beside this module (``parallel/``, ``models/``, ``checkpoint/``, ``health/``,
``inference/``); the loop itself in ``loop.py``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from axonn_launch.common import jobdir
from axonn_launch.common.fserrors import file_system_line
from axonn_launch.common.jobdir import JobPaths, record_failure
from axonn_launch.common.prompts import config_eos_ids
from axonn_launch.common.ranks import node_name
from axonn_launch.common.rules import job_problem
from axonn_launch.common.spec import JobSpec
from axonn_launch.train.checkpoint.manager import Checkpointer, resume_point
from axonn_launch.train.checkpoint.state import resume, save
from axonn_launch.train.data import EvalLoader, Geometry, Loader, open_source
from axonn_launch.train.health import preflight
from axonn_launch.train.health.faults import poisons
from axonn_launch.train.health.monitor import StepMonitor
from axonn_launch.train.health.profile import ProfileWindow
from axonn_launch.train.health.startup import log_startup, log_startup_time
from axonn_launch.train.health.watchdog import Watchdog, checkpoint_deadline
from axonn_launch.train.inference.generation import (
    byte_text,
    decode,
    default_prompt,
    generate_one,
)
from axonn_launch.train.logs import setup_logging
from axonn_launch.train.loop import NonFiniteError, TrainContext, evaluate, train_loop
from axonn_launch.train.metrics import MetricsLogger
from axonn_launch.train.models.adamw import AdamW
from axonn_launch.train.models.gpt import GPT
from axonn_launch.train.models.optim import build_optimizer, compute_dtype
from axonn_launch.train.models.registry import build_model
from axonn_launch.train.parallel.bootstrap import DistEnv, discover_env, init_distributed
from axonn_launch.train.parallel.comm import resolve_wire
from axonn_launch.train.parallel.groups import Groups, build_groups
from axonn_launch.train.sinks import open_sinks

log = logging.getLogger(__name__)


def run_job(
    spec: JobSpec,
    *,
    env: DistEnv | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> dict:
    """Train ``spec`` on this rank; returns the summary (losses and steps agree on all ranks).

    A rank that raises leaves a failure record first (``axonn_launch.records.firstfail``), so that
    the launcher and ``jobs status`` can name the rank that failed first."""
    env = env or discover_env(spec.runtime)
    setup_logging(env.rank, spec.job_dir)  # rank and host on every line (train/logs.py)
    try:
        return train_rank(spec, env, should_stop)
    except Exception as error:
        if not getattr(error, RECORDED, False):
            record_rank_failure(spec, env, error)
        raise


RECORDED = "_axonn_failure_recorded"  # set on an error whose failure record was written


def record_rank_failure(spec: JobSpec, env: DistEnv, error: Exception) -> None:
    """The rank's error in its log and its failure record (``records/firstfail``), once."""
    said = file_system_line(error) or f"{type(error).__name__}: {error}"
    log.error("rank %d failed: %s", env.rank, said)
    record_failure(spec.job_dir, env.rank, error, getattr(error, "evidence", None))
    with contextlib.suppress(AttributeError, TypeError):
        setattr(error, RECORDED, True)


def train_rank(spec: JobSpec, env: DistEnv, should_stop: Callable[[], bool] | None) -> dict:
    if env.world_size != spec.grid.world_size:
        raise ValueError(
            f"grid {spec.grid.describe()} needs {spec.grid.world_size} ranks, "
            f"the job has {env.world_size}"
        )
    configure_threads(env, spec.train.threads)
    watchdog = start_watchdog(spec, env)
    try:
        preflight.prepare(spec, env)  # before NCCL starts: its log names the network it uses
        init_distributed(env)
    except BaseException:
        stop_watchdog(watchdog)
        raise
    try:
        startup = log_startup(env)  # hosts, torch, devices and network plugin, in the job log
        preflight.run_preflight(spec, env, startup)  # raises PreflightError: do not train here
        return _run_initialized(spec, env, should_stop or (lambda: False), watchdog)
    finally:
        stop_watchdog(watchdog)
        dist.destroy_process_group()
        # Groups held in reference cycles (model <-> runtime) are freed here, joining
        # their gloo worker threads while the interpreter is still whole (groups.py).
        gc.collect()


def configure_threads(env: DistEnv, threads: int = 0, environ=os.environ) -> None:
    """``threads`` per rank, or (0) the cores shared among the ranks of this node unless
    Slurm already bound each task: then the cores it is bound to, and no more than the
    CPUs it was given (``SLURM_CPUS_PER_TASK``: on a cluster that does not bind tasks, as
    the local test cluster, every task sees every core). More threads than cores makes
    every step wait on spinning thread pools: two 2-thread jobs on 2 cores ran about 45x
    slower than one."""
    if threads > 0:
        torch.set_num_threads(threads)
        return
    cores = len(os.sched_getaffinity(0))
    per_rank = cores if env.source == "slurm" else cores // max(env.local_world_size, 1)
    given = environ.get("SLURM_CPUS_PER_TASK", "")
    if env.source == "slurm" and given.isdigit() and int(given) > 0:
        per_rank = min(per_rank, int(given))
    torch.set_num_threads(max(1, per_rank))


def start_watchdog(spec: JobSpec, env: DistEnv) -> Watchdog | None:
    """This rank's watchdog (``train/health/watchdog.py``), in its ``init`` section; None when
    ``train.watchdog=off``."""
    cfg = spec.train.watchdog
    if not cfg.enabled:
        return None
    return Watchdog(
        cfg, spec.job_dir, rank=env.rank, world_size=env.world_size, node=node_name()
    ).start()


def stop_watchdog(watchdog: Watchdog | None) -> None:
    if watchdog is not None:
        watchdog.stop()


def checkpoint_bytes_per_node(model: GPT, env: DistEnv) -> float:
    """What this node's ranks write in a save: weights and two Adam moments, fp32."""
    shard = sum(p.numel() for p in model.parameters()) * 4 * 3
    return float(shard * max(env.local_world_size, 1))


def _run_initialized(
    spec: JobSpec, env: DistEnv, should_stop: Callable[[], bool], watchdog: Watchdog | None
) -> dict:
    """The model on this rank's groups, then the generation job or the training."""
    recheck_rules(spec)
    torch.manual_seed(spec.train.seed)
    groups = build_groups(spec.grid, rank=env.rank)
    model = build_job_model(spec, env, groups)
    checkpoint_group = dist.new_group(backend="gloo")  # async saves run on their own group
    if spec.generate.prompts:
        from axonn_launch.train.inference.generate_job import run_generation_job

        return run_generation_job(spec, env, model, checkpoint_group)
    return train_model(spec, env, model, checkpoint_group, should_stop, watchdog)


def build_job_model(spec: JobSpec, env: DistEnv, groups: Groups) -> GPT:
    """The spec's architecture, sharded over ``groups``, on this rank's device."""
    train, device = spec.train, torch.device(env.device)
    return build_model(
        spec.model,
        groups=groups,
        overlap=train.overlap,
        activation_checkpointing=train.activation_checkpointing,
        seed=train.seed,
        device=device,
        wire=resolve_wire(train.wire, compute_dtype(train, device)),
        cache_layers=train.cache_layers,
        ors_window=train.ors_window,
        gemm_tuning=train.gemm_tuning,
    )


def train_model(
    spec: JobSpec,
    env: DistEnv,
    model: GPT,
    checkpoint_group: dist.ProcessGroup,
    should_stop: Callable[[], bool],
    watchdog: Watchdog | None,
) -> dict:
    """Optimizer and data, resumed where the job dir's checkpoint left them; the loop; the
    last save, what follows the training, and the summary."""
    optimizer = build_optimizer(model, spec.train)
    loader = open_loader(spec, model.groups, torch.device(env.device))
    start_step, fallback = restore(spec, env, model, optimizer, loader, checkpoint_group)
    checkpointer = Checkpointer(
        spec.job_dir, rank=env.rank, keep=spec.train.keep_checkpoints, group=checkpoint_group
    )
    ctx = train_context(spec, env, model, optimizer, loader, start_step, should_stop, watchdog)
    ctx.save = lambda step: save(spec, env, step, model, optimizer, loader, checkpointer)
    ctx.saved = checkpointer.wait
    try:
        summary = run_loop(model, ctx, checkpointer, env)
    except BaseException as error:
        ctx.logger.close_sinks(error)
        if isinstance(error, Exception) and not isinstance(error, NonFiniteError):
            record_rank_failure(spec, env, error)  # first: the rank that failed is named
            stop_watchdog(watchdog)  # this rank ends: no deadline of its own from here
            finish_save_in_flight(spec, env, model, checkpointer)
        raise
    if fallback is not None:  # the newest checkpoint was damaged: which step, and why
        summary["checkpoint_fallback"] = fallback
    return finish_training(spec, env, model, ctx, checkpointer, watchdog, summary)


def open_loader(spec: JobSpec, groups: Groups, device: torch.device) -> Loader:
    """The training data of this rank's data-parallel position."""
    train = spec.train
    return Loader(
        open_source(train.data, model_vocab=spec.model.vocab_size),
        Geometry.of(train, spec.grid, groups.coords),
        seed=train.seed,
        device=device,
        goldfish=train.goldfish,
    )


def restore(
    spec: JobSpec,
    env: DistEnv,
    model: GPT,
    optimizer: AdamW,
    loader: Loader,
    group: dist.ProcessGroup,
) -> tuple[int, dict | None]:
    """(the step to start from, what was wrong with a damaged newest checkpoint or None):
    the job dir's latest good checkpoint, else ``model.init_from``'s weights, else step 0."""
    checkpoint, fallback = resume_point(spec.job_dir, rank=env.rank, group=group)
    if checkpoint is not None:
        return resume(checkpoint, spec, env, model, optimizer, loader, group), fallback
    if spec.model.init_from:
        load_pretrained(spec, model, model.groups)
    return 0, fallback


def train_context(
    spec: JobSpec,
    env: DistEnv,
    model: GPT,
    optimizer: AdamW,
    loader: Loader,
    start_step: int,
    should_stop: Callable[[], bool],
    watchdog: Watchdog | None,
) -> TrainContext:
    """What the loop needs, with metrics from ``start_step`` on (rows past it dropped)."""
    train, groups, device = spec.train, model.groups, torch.device(env.device)
    logger = metrics_logger(spec, env, device, start_step)
    if env.rank == 0:
        truncate_metrics(JobPaths(spec.job_dir).metrics, start_step)
    return TrainContext(
        train=train,
        groups=groups,
        loader=loader,
        optimizer=optimizer,
        logger=logger,
        device=device,
        tokens_per_step=train.global_batch * train.seq_len,
        start_step=start_step,
        should_stop=should_stop,
        evaluate=validation_loss(spec, model, loader.geometry, device),
        monitor=step_monitor(spec, env, model, watchdog),
        skip=frozenset(jobdir.skipped_steps(spec.job_dir)),
        poisons=poisons(rank=env.rank, attempt=jobdir.attempt_number(spec.job_dir)),
    )


def metrics_logger(
    spec: JobSpec, env: DistEnv, device: torch.device, start_step: int = 0
) -> MetricsLogger:
    """metrics.jsonl, the other sinks and the progress lines (rank 0 writes, every rank
    measures)."""
    train = spec.train
    return MetricsLogger(
        job_dir=Path(spec.job_dir),
        model=spec.model,
        seq_len=train.seq_len,
        recompute=train.activation_checkpointing,
        world_size=env.world_size,
        peak_tflops_per_gpu=spec.runtime.peak_tflops_per_gpu,
        total_steps=train.steps,
        device=device,
        enabled=env.rank == 0,
        progress=train.progress,
        log_every_s=train.log_every_s,
        sinks=open_sinks(
            spec,
            start_step=start_step,
            attempt=jobdir.attempt_number(spec.job_dir),
            enabled=env.rank == 0,
        ),  # fmt: skip
        profile=ProfileWindow(
            train.profile, spec.job_dir, rank=env.rank, device=device, start_step=start_step
        ),  # fmt: skip
    )


def step_monitor(spec: JobSpec, env: DistEnv, model: GPT, watchdog: Watchdog | None) -> StepMonitor:
    """The watchdog's sections and the stragglers' comparison, step by step."""
    return StepMonitor(
        watchdog,
        spec.train.stragglers,
        model.groups,
        torch.device(env.device),
        job_dir=spec.job_dir,
        checkpoint_bytes_per_node=checkpoint_bytes_per_node(model, env),
        rank=env.rank,
        waits=model.comm.waits,
    )


def run_loop(model: GPT, ctx: TrainContext, checkpointer: Checkpointer, env: DistEnv) -> dict:
    """The optimizer loop's summary, with this rank's start-up time."""
    startup = log_startup_time(env)  # srun to here, per rank; where Python came from
    try:
        return train_loop(model, ctx) | {"startup": startup}
    except NonFiniteError as error:
        # every rank raises it at the same step (its values are agreed), so all can wait
        # together: the last good step's save, still in flight, is published first
        with ctx.monitor.section("checkpoint", error.evidence["step"]):
            checkpointer.wait()
        raise


def finish_save_in_flight(
    spec: JobSpec, env: DistEnv, model: GPT, checkpointer: Checkpointer
) -> None:
    """This rank failed while a save was in flight: let the save complete first (up to the
    watchdog's deadline of a save), so that the steps before it are not lost with the
    rank. A failure of this rank's own (its code, memory, storage) leaves its peers' saving
    threads running, and the save completes; a peer that died ends it at once."""
    timeout = checkpoint_deadline(spec.train.watchdog, checkpoint_bytes_per_node(model, env))
    name, became = checkpointer.finish_in_flight(timeout)
    if name:
        log.info("rank %d: the checkpoint %s in flight when it failed: %s", env.rank, name,
                 became)  # fmt: skip


def finish_training(
    spec: JobSpec,
    env: DistEnv,
    model: GPT,
    ctx: TrainContext,
    checkpointer: Checkpointer,
    watchdog: Watchdog | None,
    summary: dict,
) -> dict:
    """The last save published, what follows the training, the summary written."""
    saving = f"writing the checkpoint of step {summary['steps']}; the job ends after it"
    with ctx.monitor.section("checkpoint", summary["steps"]), said_if_slow(env.rank, saving):
        checkpointer.wait()  # the last save completes before the job reports success
    stop_watchdog(watchdog)  # what follows the training (sample, memorization) has no deadline
    ctx.logger.close_bar()
    if not stopped_early(spec, summary):  # a stop saves and ends: no sample of half a run
        summary |= after_training(spec, env, model, summary)
    ctx.logger.finish(summary)
    write_summary(spec, env, summary)
    return summary


PENDING = "pending"  # an after-training step not (yet) finished: a crash leaves it so
SILENT_S = 10.0  # a phase with no log line for longer than this says what it is doing


def stopped_early(spec: JobSpec, summary: dict) -> bool:
    """Whether the loop stopped on request (a signal) with steps left to train."""
    return bool(summary.get("stopped")) and summary["steps"] < spec.train.steps


@contextlib.contextmanager
def said_if_slow(rank: int, what: str, after_s: float = SILENT_S) -> Iterator[None]:
    """Rank 0 logs ``what`` once the block has run ``after_s`` seconds (a final checkpoint
    that is still being written): the console never goes silent for longer without a word.
    How long a save takes is not known before it starts, so the line comes when it is."""
    timer = threading.Timer(after_s, lambda: log.info("%s (%.0f s so far)", what, after_s))
    timer.daemon = True
    if rank == 0:
        timer.start()
    try:
        yield
    finally:
        timer.cancel()


def after_training(spec: JobSpec, env: DistEnv, model: GPT, summary: dict) -> dict:
    """Run the steps that follow a finished training (sample, memorization), recording
    each outcome in ``summary["after_training"]``. The training is written to summary.json
    first, and a step that raises is logged in one line, not raised: what fails after the
    training never makes the trained model a failed job (``jobs status`` says COMPLETED
    and shows what did not finish)."""
    steps = after_training_steps(spec, env, model)
    outcomes = summary["after_training"] = {name: PENDING for name in steps}
    write_summary(spec, env, summary)
    found: dict = {}
    for name, step in steps.items():
        try:
            found |= step()
        except Exception as error:
            outcomes[name] = f"failed: {type(error).__name__}: {first_line(error)}"
            log.error("%s %s; the training finished and is saved", name, outcomes[name])
            log.debug("%s: traceback", name, exc_info=True)
        else:
            outcomes[name] = "done"
        write_summary(spec, env, summary | found)
    return found


def after_training_steps(spec: JobSpec, env: DistEnv, model: GPT) -> dict[str, Callable]:
    """name -> a step returning what it adds to the summary (every rank runs each)."""
    device = torch.device(env.device)
    steps: dict[str, Callable[[], dict]] = {}
    if spec.train.sample_tokens > 0:
        steps["sample"] = lambda: {"sample": print_sample(spec, env, model, device)}
    if spec.memorization.data:  # memorization.json and its means in the summary
        from axonn_launch.train.inference.memorize_job import run_memorization

        steps["memorization"] = lambda: run_memorization(spec, model, device, env.rank)
    return steps


def write_summary(spec: JobSpec, env: DistEnv, summary: dict) -> None:
    """summary.json (rank 0)."""
    if env.rank == 0:
        jobdir.write_summary(spec.job_dir, summary)


def first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else ""


def load_pretrained(spec: JobSpec, model: GPT, groups: Groups) -> None:
    """Start from the Hugging Face weights of ``model.init_from``, each rank reading only
    the slices it owns (``train/models/hf_import.py``)."""
    from axonn_launch.train.models.hf_import import load_hf_weights

    stats = load_hf_weights(model, groups, spec.model.init_from)
    log.info(
        "weights from %s: %d bytes read by this rank from %d tensors",
        spec.model.init_from, stats.bytes_read, stats.tensors_touched,
    )  # fmt: skip


def validation_loss(spec: JobSpec, model: GPT, geometry: Geometry, device: torch.device):
    """The validation loss as a function of no arguments, or None (``eval_batches`` 0): read
    as the training is (``geometry``: the training loader's)."""
    train = spec.train
    if train.eval_batches < 1:
        return None
    data, split = (train.eval_data, "all") if train.eval_data else (train.data, "val")
    batches = EvalLoader(
        open_source(data, model_vocab=spec.model.vocab_size, split=split),
        geometry,
        batches=train.eval_batches,
        device=device,
    )
    dtype, groups = compute_dtype(train, device), model.groups
    return lambda batch_done: evaluate(model, list(batches), groups, device, dtype, batch_done)


def recheck_rules(spec: JobSpec) -> None:
    """The login node's rules (``axonn_launch.common.rules``), checked again before building."""
    problem = job_problem(spec.model, spec.grid, spec.train)
    if problem:
        raise ValueError(problem)


def truncate_metrics(path: Path, start_step: int) -> None:
    """On resume, drop rows logged after the checkpoint so each step appears once, and
    rows that are not whole JSON (a line cut off when the disk filled mid-write)."""
    if not path.exists():
        return
    kept, cut = jobdir.metrics_through(path, start_step)
    if cut:
        log.warning("%s: dropped %d line(s) cut off mid-write", path.name, cut)
    path.write_text("".join(line + "\n" for line in kept))


def print_sample(spec: JobSpec, env: DistEnv, model: GPT, device: torch.device) -> str:
    tokens = generate_one(
        model,
        default_prompt(spec.train.data),
        spec.train.sample_tokens,
        max_seq_len=spec.model.max_seq_len,
        device=device,
        dtype=compute_dtype(spec.train, device),
        seed=spec.train.seed,
        group=model.groups.world,
        expect=lambda seconds: announce_sample(env.rank, spec.train.sample_tokens, seconds),
        eos_ids=config_eos_ids(spec.model.init_from),  # none for the byte corpus's models
    )
    text = decode(tokens, spec.train.data)  # recorded as written (summary.json)
    if env.rank == 0:
        shown = readable_sample(tokens, spec.train.data)
        log.info("--- sample (%d tokens) ---\n%s\n---", spec.train.sample_tokens, shown)
    return text


UNREADABLE = "\N{MIDDLE DOT}"  # a byte of the sample that is not text


def readable_sample(tokens: list[int], data: str) -> str:
    """The sample as the console shows it: for the byte-level corpus, text with each byte
    that is not (undecodable, a control code) as a dot, and a note when most of it is not
    text yet (a short run's model strings bytes together); token ids otherwise."""
    if data != "shakespeare":
        return decode(tokens, data)
    text = byte_text(tokens, errors="replace")
    shown = "".join(c if c in "\n\t" or (c.isprintable() and c != "\ufffd") else UNREADABLE
                    for c in text)  # fmt: skip
    unreadable = shown.count(UNREADABLE)
    if unreadable * 4 <= len(shown):
        return shown
    return (
        f"{shown}\n(not readable yet: {unreadable} of {len(shown)} characters are not text,"
        f" shown as {UNREADABLE}; a longer run (train.steps) writes text)"
    )


def announce_sample(rank: int, n_tokens: int, seconds: float) -> None:
    """Rank 0's line before a sample that will keep the console quiet past ``SILENT_S``."""
    if rank == 0 and seconds > SILENT_S:
        log.info("sampling %d tokens from the trained model: about %.0f s", n_tokens, seconds)
