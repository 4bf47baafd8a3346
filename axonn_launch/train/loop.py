"""The optimizer loop: AdamW, warmup + cosine schedule, accumulation, clipping, logging.

One optimizer step runs ``accumulation`` micro-steps, then ``finish_gradients``
(deferred reduce-scatters, z and data all-reduces), global-norm clipping and
``optimizer.step()``. The loss of a step is the mean over the labels that count (those
the loader did not set to ``IGNORE_INDEX``: fine-tuning prompts, Goldfish drops) of all
its micro-steps and ranks: one all-reduce of the local counts over z and data at the
start of the step gives their number, each micro-step backpropagates its sum divided by
it, and the gradients are summed, so ranks holding different numbers of counted labels
weigh each label the same. At each step
boundary one small all-reduce over the world averages the loss for logging and agrees
on whether any rank asked to stop (``should_stop``, e.g. set by a requeue signal) and
whether any rank's GEMM tuner made new picks (``train/gemm.py``; normally in the first
step only), which are then gathered into the metrics.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from axonn_launch.common.spec import TrainConfig
from axonn_launch.train.data import IGNORE_INDEX, Loader, MicroBatch
from axonn_launch.train.gemm import GemmTuner
from axonn_launch.train.groups import Groups
from axonn_launch.train.metrics import MetricsLogger, StepStats, memory_gib
from axonn_launch.train.model import clip_grad_norm_, finish_gradients

log = logging.getLogger(__name__)


def is_matrix(param: nn.Parameter) -> bool:
    """Weight decay applies to matrices (Linear weights, embeddings), not biases or norms.

    Sharded weights are stored flattened, so the full tensor's shape is read from the
    parameter's ``shard_layout`` (set by the parallel layers) when it has one.
    """
    layout = getattr(param, "shard_layout", None)
    shape = layout.full_shape if layout is not None else param.shape
    return len(shape) >= 2


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if is_matrix(param) else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=1e-8)


def learning_rate(step: int, train: TrainConfig) -> float:
    """Learning rate for the 0-based optimizer step ``step``."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return train.lr
    if train.schedule != "cosine":
        raise ValueError(f"train.schedule={train.schedule!r}: use cosine or constant")
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))


def compute_dtype(train: TrainConfig, device: torch.device) -> torch.dtype:
    if train.dtype not in ("auto", "fp32", "bf16"):
        raise ValueError(f"train.dtype={train.dtype!r}: use auto, fp32 or bf16")
    return torch.bfloat16 if train.computes_in_bf16(device.type == "cuda") else torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """bf16 autocast (fp32 master weights and optimizer); fp32 runs without autocast."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class StopFlag:
    """A ``should_stop`` hook that a signal handler can set (only assigns a bool)."""

    def __init__(self) -> None:
        self.requested = False

    def request(self, *_: object) -> None:
        self.requested = True

    def __call__(self) -> bool:
        return self.requested


@dataclass
class TrainContext:
    """Everything the loop needs besides the model; built by ``axonn_launch.train.run``."""

    train: TrainConfig
    groups: Groups
    loader: Loader
    optimizer: torch.optim.Optimizer
    logger: MetricsLogger
    device: torch.device
    tokens_per_step: int
    start_step: int = 0  # optimizer steps already done (resume)
    should_stop: Callable[[], bool] = lambda: False
    save: Callable[[int], None] = lambda step: None  # checkpoint after ``step`` steps
    evaluate: Callable[[], float] | None = None  # the validation loss (collective)


def train_loop(model: nn.Module, ctx: TrainContext) -> dict:
    """Run optimizer steps from ``ctx.start_step`` to ``train.steps``; returns a summary."""
    train, dtype = ctx.train, compute_dtype(ctx.train, ctx.device)
    accumulation = ctx.loader.accumulation
    step, stopped, timed = ctx.start_step, False, []
    loss, tuner, val_loss = float("nan"), gemm_tuner(model), None
    log.info(
        "training steps %d..%d: %d micro-steps of %d sequences each, %s, %d tokens per step",
        step + 1, train.steps, accumulation, train.micro_batch, dtype, ctx.tokens_per_step,
    )  # fmt: skip
    model.train()
    while step < train.steps:
        started, began = time.perf_counter(), time.time()
        lr = learning_rate(step, train)
        local_loss = run_micro_steps(model, ctx.loader.next_step(), ctx.groups, ctx.device, dtype)
        finish_gradients(model, ctx.groups, average=False)
        max_norm = train.grad_clip if train.grad_clip > 0 else math.inf  # 0: measure only
        grad_norm = clip_grad_norm_(model, max_norm, ctx.groups)
        for group in ctx.optimizer.param_groups:
            group["lr"] = lr
        ctx.optimizer.step()
        ctx.optimizer.zero_grad(set_to_none=True)
        loss, (stop, new_picks) = average_loss_and_flags(
            local_loss, (ctx.should_stop(), tuner_has_new(tuner)), ctx.device, ctx.groups
        )
        step += 1
        if new_picks:  # some rank tuned GEMMs in this step: into the metrics (rank 0)
            ctx.logger.add_gemm_choices(gather_gemm_choices(tuner, ctx.groups.world), step)
        elapsed = time.perf_counter() - started
        timed.append(elapsed)
        evaluated = ctx.evaluate is not None and evaluation_due(step, train, stop)
        if evaluated:
            val_loss = ctx.evaluate()
        if step % train.log_every == 0 or step == train.steps or stop or evaluated:
            ctx.logger.record(
                StepStats(step, loss, lr, float(grad_norm), elapsed, ctx.tokens_per_step,
                          val_loss if evaluated else None)
            )  # fmt: skip
        ctx.logger.mark("step", step, began)
        if stop or step == train.steps or periodic_checkpoint(step, train):
            saving = time.time()
            ctx.save(step)
            ctx.logger.mark("checkpoint", step, saving)
        if stop:
            log.info("stopped after step %d on request; checkpoint saved", step)
            stopped = True
            break
    return summarize(ctx, step, loss, timed, stopped) | {"val_loss": val_loss}


def evaluation_due(step: int, train: TrainConfig, stop: bool) -> bool:
    """Every ``eval_every`` steps and after the last (also a stop's last) step."""
    if train.eval_batches < 1:
        return False
    return step == train.steps or stop or (train.eval_every > 0 and step % train.eval_every == 0)


def periodic_checkpoint(step: int, train: TrainConfig) -> bool:
    return train.checkpoint_every > 0 and step % train.checkpoint_every == 0


Batch = list[MicroBatch]


def counted_labels(batches: Batch, groups: Groups, device: torch.device) -> torch.Tensor:
    """Labels that count in the loss over all micro-batches and ranks of one step (the
    x*y plane members hold the same rows, so the sum runs over z and data)."""
    count = sum((batch.targets != IGNORE_INDEX).sum() for batch in batches)
    total = torch.as_tensor(count, dtype=torch.float32, device=device).reshape(())
    for axis in ("z", "data"):
        if groups.size(axis) > 1:
            dist.all_reduce(total, group=groups.group(axis))
    return total.clamp(min=1)


def run_micro_steps(
    model: nn.Module, batches: Batch, groups: Groups, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Forward and backward of every micro-batch of one step; returns this rank's share
    of the step's loss (the loss is the sum of the shares of one x*y plane member per
    z and data index)."""
    normalizer = counted_labels(batches, groups, device)
    total = torch.zeros((), device=device)
    for inputs, targets, examples in batches:
        with autocast(device, dtype):
            loss = model(inputs, targets, normalizer=normalizer, examples=examples)
        loss.backward()
        total += loss.detach().float()
    return total


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Batch, groups: Groups, device: torch.device, dtype: torch.dtype
) -> float:
    """The mean loss over the counted labels of ``batches`` (all ranks' rows), with the
    model in eval mode: the validation loss, the same on every grid."""
    was_training = model.training
    model.eval()
    normalizer = counted_labels(batches, groups, device)
    total = torch.zeros((), device=device)
    for inputs, targets, examples in batches:
        with autocast(device, dtype):
            total += model(inputs, targets, normalizer=normalizer, examples=examples).float()
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
