"""The optimizer loop: AdamW, warmup + cosine schedule, accumulation, clipping, logging.

One optimizer step runs ``accumulation`` micro-steps, then ``finish_gradients``,
global-norm clipping and ``optimizer.step()``. One small all-reduce per step boundary
averages the loss and agrees on stopping; the non-finite guard needs no collective of
its own. ``train/health/monitor.py`` marks the watchdog's sections.

How the loss is weighted and how every rank agrees: ``docs/job-side.md``
("train/loop.py").
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from axonn_launch.common.failure_classes import NON_FINITE
from axonn_launch.common.spec import TrainConfig
from axonn_launch.train.data import IGNORE_INDEX, Loader, MicroBatch
from axonn_launch.train.health.faults import StopFlag  # here too, where it was first
from axonn_launch.train.health.monitor import StepMonitor
from axonn_launch.train.metrics import MetricsLogger, StepStats, memory_gib
from axonn_launch.train.models.adamw import AdamW
from axonn_launch.train.models.gpt import clip_grad_norm_, finish_gradients
from axonn_launch.train.models.optim import autocast, compute_dtype
from axonn_launch.train.parallel.comm import WaitClock
from axonn_launch.train.parallel.gemm import GemmTuner
from axonn_launch.train.parallel.groups import Groups

log = logging.getLogger(__name__)
__all__ = ["StopFlag", "TrainContext", "train_loop"]


def learning_rate(step: int, train: TrainConfig) -> float:
    """Learning rate for the 0-based optimizer step ``step``: a linear warmup over
    ``warmup_steps``, then a cosine from ``lr`` to ``min_lr`` at ``steps``.

    The schedule starts at ``train.schedule_start`` (0 for a new run): an extension of a
    finished run (``jobs resubmit <dir> train.steps=N``) restarts it there, a warmup and a
    whole cosine over its own steps, as continued pre-training re-warms and re-decays; a
    stretched cosine would jump from ``min_lr`` to mid-schedule with no warmup."""
    step -= train.schedule_start
    steps = train.steps - train.schedule_start
    if step < train.warmup_steps:
        return train.lr * (max(step, 0) + 1) / train.warmup_steps
    if train.schedule == "constant":
        return train.lr
    if train.schedule != "cosine":
        raise ValueError(f"train.schedule={train.schedule!r}: use cosine or constant")
    decay_steps = max(1, steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass
class TrainContext:
    """Everything the loop needs besides the model; built by ``axonn_launch.train.run``."""

    train: TrainConfig
    groups: Groups
    loader: Loader
    optimizer: AdamW
    logger: MetricsLogger
    device: torch.device
    tokens_per_step: int
    start_step: int = 0  # optimizer steps already done (resume)
    should_stop: Callable[[], bool] = lambda: False
    save: Callable[[int], None] = lambda step: None  # checkpoint after ``step`` steps
    saved: Callable[[], None] = lambda: None  # returns once the last save is published
    # the validation loss (collective), told what to call after each evaluation batch
    evaluate: Callable[[Callable[[], None]], float] | None = None
    monitor: StepMonitor | None = None  # watchdog sections and straggler exchange
    skip: frozenset[int] = frozenset()  # steps whose batch is skipped (a rollback)
    poisons: dict[int, str] = field(default_factory=dict)  # step -> nan_loss | nan_grad


def train_loop(model: nn.Module, ctx: TrainContext) -> dict:
    """Run optimizer steps from ``ctx.start_step`` to ``train.steps``; returns a summary."""
    train, dtype = ctx.train, compute_dtype(ctx.train, ctx.device)
    accumulation = ctx.loader.accumulation
    step, stopped, timed = ctx.start_step, False, []
    loss, tuner, val_loss = float("nan"), gemm_tuner(model), None
    monitor = ctx.monitor or StepMonitor(None, train.stragglers, ctx.groups, ctx.device)
    log.info(
        "training steps %d..%d: %d micro-steps of %d sequences each, %s, %d tokens per step",
        step + 1, train.steps, accumulation, train.micro_batch, dtype, ctx.tokens_per_step,
    )  # fmt: skip
    model.train()
    while step < train.steps:
        started, began = time.perf_counter(), time.time()
        monitor.begin_step(step + 1, timed)
        lr = learning_rate(step, train)
        batches = next_batches(ctx, step + 1)
        monitor.mark("compute")
        poison = ctx.poisons.get(step + 1)
        local_loss = run_micro_steps(model, batches, ctx.groups, ctx.device, dtype)
        if poison:
            local_loss = apply_poison(poison, model, local_loss)
        finish_gradients(model, ctx.groups, average=False)
        max_norm = train.grad_clip if train.grad_clip > 0 else math.inf  # 0: measure only
        grad_norm = clip_grad_norm_(model, max_norm, ctx.groups)
        stop_asked = ctx.should_stop()
        monitor.compute_done()
        monitor.mark("sync")
        loss, (stop, new_picks) = average_loss_and_flags(
            local_loss, (stop_asked, tuner_has_new(tuner)), ctx.device, ctx.groups
        )
        if train.check_finite:
            check_finite(step + 1, loss, grad_norm)
        for group in ctx.optimizer.param_groups:
            group["lr"] = lr
        ctx.optimizer.step()
        ctx.optimizer.zero_grad(set_to_none=True)
        step += 1
        if new_picks:  # some rank tuned GEMMs in this step: into the metrics (rank 0)
            ctx.logger.add_gemm_choices(gather_gemm_choices(tuner, ctx.groups.world), step)
        elapsed = time.perf_counter() - started
        timed.append(elapsed)
        monitor.after_step(step, timed, ctx.logger)
        ctx.logger.mark("step", step, began)
        final = stop or step == train.steps
        if final or periodic_checkpoint(step, train):
            save_step(ctx, monitor, step)
        evaluated = ctx.evaluate is not None and evaluation_due(step, train, stop)
        if evaluated:
            val_loss = evaluate_after(ctx, monitor, step, final)
        if step % train.log_every == 0 or final or evaluated:
            ctx.logger.record(
                StepStats(step, loss, lr, float(grad_norm), elapsed, ctx.tokens_per_step,
                          val_loss if evaluated else None)
            )  # fmt: skip
        if stop:
            log.info("stopped after step %d on request; checkpoint saved", step)
            stopped = True
            break
    summary = summarize(ctx, step, loss, timed, stopped) | {"val_loss": val_loss}
    return summary | monitor.summary()


def save_step(ctx: TrainContext, monitor: StepMonitor, step: int) -> None:
    """Start the checkpoint of ``step`` (asynchronous where the checkpointer is), on the
    watchdog's checkpoint clock, and mark it on the timeline."""
    saving = time.time()
    with monitor.section("checkpoint", step):
        ctx.save(step)
    ctx.logger.mark("checkpoint", step, saving)


def evaluate_after(ctx: TrainContext, monitor: StepMonitor, step: int, final: bool) -> float:
    """The validation loss after ``step``, on the watchdog's evaluation clock (a deadline
    per batch) and the timeline. Before the run's last evaluation its last save is
    published, so that an evaluation that fails or hangs costs no training."""
    if final:
        with monitor.section("checkpoint", step):
            ctx.saved()
    began = time.time()
    with monitor.section("eval", step):
        val_loss = ctx.evaluate(monitor.eval_batch_done)
    ctx.logger.mark("eval", step, began)
    return val_loss


class NonFiniteError(ArithmeticError):
    """A step whose loss or gradient norm is not finite; it was not applied."""

    def __init__(self, step: int, first: str, loss: float, grad_norm: float) -> None:
        other, value = ("gradients", grad_norm) if first == "loss" else ("loss", loss)
        other_state = "finite" if math.isfinite(value) else "not finite"
        super().__init__(
            f"non-finite {first} at step {step} ({other} {other_state}); the step was not"
            f" applied and nothing was saved at or after it"
        )
        self.evidence = {"failure_class": NON_FINITE, "step": step, "first": first}


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    """Raise ``NonFiniteError`` (on every rank alike: both values are agreed) before the
    optimizer step when the loss or the gradient norm is not finite. The loss is computed
    before the gradients, so a bad loss is named first."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    first = "loss" if not math.isfinite(loss) else "gradients"
    error = NonFiniteError(step, first, loss, grad_norm)
    log.error("axonn_launch: non_finite: %s", error)
    raise error


def next_batches(ctx: TrainContext, step: int) -> Batch:
    """Step ``step``'s micro-batches; a step a rollback skips (``ctx.skip``) discards the
    batch that made it non-finite and takes the next one."""
    batches = ctx.loader.next_step()
    if step in ctx.skip:
        log.warning("step %d: skipping the batch that made it non-finite (rollback)", step)
        batches = ctx.loader.next_step()
    return batches


def apply_poison(kind: str, model: nn.Module, local_loss: torch.Tensor) -> torch.Tensor:
    """The fault injections ``nan_loss`` and ``nan_grad`` (``train/health/faults.py``)."""
    if kind == "nan_loss":
        return local_loss * float("nan")
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    grad.view(-1)[0] = float("nan")
    return local_loss


def evaluation_due(step: int, train: TrainConfig, stop: bool) -> bool:
    """Every ``eval_every`` steps and after the last (also a stop's last) step."""
    if train.eval_batches < 1:
        return False
    return step == train.steps or stop or (train.eval_every > 0 and step % train.eval_every == 0)


def periodic_checkpoint(step: int, train: TrainConfig) -> bool:
    return train.checkpoint_every > 0 and step % train.checkpoint_every == 0


Batch = list[MicroBatch]


def counted_labels(
    batches: Batch, groups: Groups, device: torch.device, waits: WaitClock | None = None
) -> torch.Tensor:
    """Labels that count in the loss over all micro-batches and ranks of one step (the
    x*y plane members hold the same rows, so the sum runs over z and data); the time
    blocked in those sums goes on ``waits``."""
    count = sum((batch.targets != IGNORE_INDEX).sum() for batch in batches)
    total = torch.as_tensor(count, dtype=torch.float32, device=device).reshape(())
    for axis in ("z", "data"):
        if groups.size(axis) > 1:
            with waits.span(total) if waits else contextlib.nullcontext():
                dist.all_reduce(total, group=groups.group(axis))
    return total.clamp(min=1)


def run_micro_steps(
    model: nn.Module, batches: Batch, groups: Groups, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Forward and backward of every micro-batch of one step; returns this rank's share
    of the step's loss (the loss is the sum of the shares of one x*y plane member per
    z and data index)."""
    normalizer = counted_labels(batches, groups, device, model.comm.waits)
    total = torch.zeros((), device=device)
    for inputs, targets, examples in batches:
        with autocast(device, dtype):
            loss = model(inputs, targets, normalizer=normalizer, examples=examples)
        loss.backward()
        total += loss.detach().float()
    return total


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Batch,
    groups: Groups,
    device: torch.device,
    dtype: torch.dtype,
    batch_done: Callable[[], None] = lambda: None,
) -> float:
    """The mean loss over the counted labels of ``batches`` (all ranks' rows), with the
    model in eval mode: the validation loss, the same on every grid. ``batch_done`` is
    called after each batch (the watchdog's progress: an evaluation's deadline is per
    batch, so a long healthy evaluation is never a hang)."""
    was_training = model.training
    model.eval()
    normalizer = counted_labels(batches, groups, device)
    total = torch.zeros((), device=device)
    for inputs, targets, examples in batches:
        with autocast(device, dtype):
            total += model(inputs, targets, normalizer=normalizer, examples=examples).float()
        batch_done()
    model.train(was_training)
    loss, _ = average_loss_and_flags(total, (), device, groups)
    return loss


def average_loss_and_flags(
    share: torch.Tensor, flags: tuple[bool, ...], device: torch.device, groups: Groups
) -> tuple[float, tuple[bool, ...]]:
    """The step's loss from every rank's share (``run_micro_steps``), and for each flag
    whether any rank set it (e.g. asks to stop): one all-reduce over ``groups.world``."""
    flag_values = torch.tensor(flags, dtype=torch.float32, device=device)
    packed = torch.cat([share.float().reshape(1), flag_values])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(packed, group=groups.world)
    loss_sum, *counts = packed.tolist()
    return loss_sum / groups.size("plane"), tuple(count > 0 for count in counts)


def gemm_tuner(model: nn.Module) -> GemmTuner | None:
    """The model's GEMM tuner (on its ``OverlapRuntime``), if it has one."""
    tuner = getattr(getattr(model, "runtime", None), "tuner", None)
    return tuner if isinstance(tuner, GemmTuner) else None


def tuner_has_new(tuner: GemmTuner | None) -> bool:
    return tuner is not None and tuner.has_new


def gather_gemm_choices(tuner: GemmTuner | None, group=None) -> dict[str, dict[str, str]]:
    """Every rank's GEMM picks made since the last gather, by rank (collective on
    ``group``, which holds every rank in rank order; None: the default group)."""
    mine = tuner.take_new() if tuner is not None else {}
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return {"0": mine} if mine else {}
    gathered: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine, group=group)
    return {str(rank): picks for rank, picks in enumerate(gathered) if picks}


def summarize(ctx: TrainContext, step: int, loss: float, timed: list[float], stopped: bool) -> dict:
    """Throughput over this run's steps, leaving out the first (warm-up) when there are more."""
    measured = timed[1:] if len(timed) > 1 else timed
    seconds = sum(measured) or float("nan")
    tokens = ctx.tokens_per_step * len(measured)
    tflops = ctx.logger.tflops_per_gpu(tokens, seconds) if measured else float("nan")
    peak = ctx.logger.peak
    return {
        "steps": step,
        "steps_run": len(timed),
        "resumed_from": ctx.start_step,
        "final_loss": loss,
        "tokens_per_s": tokens / seconds if measured else float("nan"),
        "step_time_s": seconds / len(measured) if measured else float("nan"),
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak > 0 else None,
        "elapsed_s": sum(timed),
        "mem_gb": memory_gib(ctx.device),
        "stopped": stopped,
        "gemm_choices": ctx.logger.gemm_choices,  # rank -> GEMM signature -> formulation
    }
