"""Per-step metrics: ``<job_dir>/metrics.jsonl`` (rank 0), a progress line, a summary.

Throughput follows AxoNN/Megatron: model FLOPs per token from Narayanan et al.'s formula
(``ModelSpec.flops_per_token``, counting the recompute forward when activation
checkpointing is on), times tokens per second, divided by the number of GPUs.
``mem_gb`` is in GiB (2**30 bytes), like ``axonn_launch.cost.memory``.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from axonn_launch.common.jobdir import JobPaths, append_line, append_timeline
from axonn_launch.common.models import ModelSpec
from axonn_launch.train.health.profile import ProfileWindow
from axonn_launch.train.sinks import Sinks

GIB = 1024**3

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    step: int  # 1-based count of optimizer steps done
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens: int  # tokens processed by the whole job in this step
    val_loss: float | None = None  # the validation loss after this step, when evaluated


def memory_gib(device: torch.device) -> float:
    """Peak CUDA allocation on GPU; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux: KiB


class MetricsLogger:
    """Writes metrics on rank 0 only; other ranks get a logger that does nothing.

    Progress: on a terminal (``stream``), a bar redrawn in place and closed by a newline
    at the last step; anywhere else (a Slurm log, a pipe) a logged line every
    ``log_every_s`` seconds, and at the first and last step, with an ETA. The summary
    line is logged."""

    def __init__(
        self,
        *,
        job_dir: Path,
        model: ModelSpec,
        seq_len: int,
        recompute: bool,
        world_size: int,
        peak_tflops_per_gpu: float,
        total_steps: int,
        device: torch.device,
        enabled: bool,
        progress: bool,
        log_every_s: float = 30.0,
        stream: TextIO | None = None,
        sinks: Sinks | None = None,
        profile: ProfileWindow | None = None,
    ) -> None:
        self.flops_per_token = model.flops_per_token(seq_len, recompute=recompute)
        self.world_size = world_size
        self.peak = peak_tflops_per_gpu
        self.total_steps = total_steps
        self.device = device
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.per = throughput_unit(device)
        self.bar = enabled and progress and self.stream.isatty()
        self.lines = enabled and progress and not self.bar
        self.log_every_s = log_every_s
        self.bar_open = False
        self.last_line = float("-inf")
        self.first_step: int | None = None
        self.path = JobPaths(job_dir).metrics
        self.job_dir = job_dir
        self.start = time.perf_counter()
        self.last: dict | None = None
        self.gemm_choices: dict[str, dict[str, str]] = {}  # rank -> signature -> formulation
        self.pending_gemm: dict[str, dict[str, str]] = {}  # not yet in a row
        self.pending_stragglers: list[dict] | None = None  # not yet in a row
        self.sinks = sinks or Sinks([])  # TensorBoard, W&B (train/sinks.py), rank 0's
        self.profile = profile  # train.profile.steps, every rank's (train/health/profile.py)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def tflops_per_gpu(self, tokens: int, seconds: float) -> float:
        return self.flops_per_token * tokens / seconds / self.world_size / 1e12

    def record(self, stats: StepStats) -> dict:
        """Build the step's metrics; on rank 0 append them as one JSON line."""
        tflops = self.tflops_per_gpu(stats.tokens, stats.step_time_s)
        row = {
            "step": stats.step,
            "loss": stats.loss,
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "step_time_s": stats.step_time_s,
            "tokens_per_s": stats.tokens / stats.step_time_s,
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak if self.peak > 0 else None,
            "mem_gb": memory_gib(self.device),
            "elapsed_s": time.perf_counter() - self.start,
        }
        if stats.val_loss is not None:
            row["val_loss"] = stats.val_loss
        if self.pending_gemm:
            row["gemm_choices"] = gemm_tally(self.pending_gemm)
            self.pending_gemm = {}
        if self.pending_stragglers:
            row["stragglers"], self.pending_stragglers = self.pending_stragglers, None
        self.last = row
        if self.enabled:
            append_line(self.path, json.dumps(row))  # whole, even when the disk fills
            self.sinks.log(row)
            self.show_progress(row)
        return row

    def mark(self, kind: str, step: int, start: float) -> None:
        """On rank 0, time the step or checkpoint save ``kind`` that began at ``start``
        (``time.time()``) and ends now, into the attempt's timeline (goodput)."""
        if self.enabled:
            append_timeline(self.job_dir, {kind: step, "start": start, "end": time.time()})
        if kind == "checkpoint":
            self.sinks.checkpointed(step)  # what a later attempt will not redo
        if kind == "step" and self.profile is not None:
            self.profile.step_done(step)

    def add_gemm_choices(self, per_rank: dict[str, dict[str, str]], step: int) -> None:
        """GEMM tuner picks (rank -> signature -> formulation) made up to ``step``: all of
        them go to the summary; the next row gets a tally (signature -> formulation ->
        ranks), which stays small however many ranks there are; each rank's own picks
        are in its log."""
        for rank, picks in per_rank.items():
            self.gemm_choices.setdefault(rank, {}).update(picks)
            self.pending_gemm.setdefault(rank, {}).update(picks)
        if self.enabled and per_rank:
            log.info(gemm_line(per_rank, step))

    def add_stragglers(self, report: dict) -> None:
        """The ranks a straggler exchange named go into the next row."""
        self.pending_stragglers = report["stragglers"]

    def show_progress(self, row: dict) -> None:
        if self.first_step is None:
            self.first_step = row["step"] - 1  # a resumed run counts its ETA from here
        last = row["step"] >= self.total_steps
        if self.bar:
            line = progress_line(row, self.total_steps, self.first_step, self.per)
            self.stream.write("\r" + line + CLEAR_TO_END)
            self.bar_open = not last
            self.stream.write("\n" if last else "")
            self.stream.flush()
        elif self.lines:
            now = time.perf_counter()
            if last or now - self.last_line >= self.log_every_s:
                self.last_line = now
                log.info(status_line(row, self.total_steps, self.first_step))

    def finish(self, summary: dict) -> None:
        if self.profile is not None:
            self.profile.stop()  # a window past the last step ends with the training
        if not self.enabled:
            return
        self.close_bar()
        log.info(summary_line(summary, self.per))
        self.sinks.close(summary)

    def close_sinks(self, error: BaseException | None = None) -> None:
        """A failed run's sinks closed (an unfinished W&B run marked failed), and an open
        profile window's memory snapshot dumped if it ran out of memory."""
        if self.profile is not None and error is not None:
            self.profile.failed(error)
        self.sinks.close(None)

    def close_bar(self) -> None:
        """End the bar's line before anything else prints (stopped early, a sample)."""
        if self.bar_open:
            self.stream.write("\n")
            self.stream.flush()
            self.bar_open = False


CLEAR_TO_END = "\x1b[K"  # a shorter line leaves none of the longer one behind


def throughput_unit(device: torch.device) -> str:
    """What TFLOP/s are divided by: a GPU on GPUs; on CPU a rank (a process of several
    cores), not a "gpu" the run does not have."""
    return "gpu" if device.type == "cuda" else "rank"


def eta_s(row: dict, total_steps: int, first_step: int = 0) -> float:
    """Seconds left at this run's pace, counted from ``first_step`` (a resumed run's
    start); nan before a step is done."""
    done = row["step"] - first_step
    return row["elapsed_s"] / done * (total_steps - row["step"]) if done > 0 else float("nan")


def progress_line(
    row: dict, total_steps: int, first_step: int = 0, per: str = "gpu", width: int = 20
) -> str:
    """``[######..............] 3/10 loss 2.5000 lr 1.00e-03 2048 tok/s 0.0146 TFLOP/s/rank
    12s, eta 28s``"""
    done = min(width, width * row["step"] // max(total_steps, 1))
    bar = "#" * done + "." * (width - done)
    return (
        f"[{bar}] {row['step']}/{total_steps} loss {row['loss']:.4f} "
        f"lr {row['lr']:.2e} {row['tokens_per_s']:.0f} tok/s "
        f"{row['tflops_per_gpu']:.3g} TFLOP/s/{per} {row['elapsed_s']:.0f}s, "
        f"eta {format_duration(eta_s(row, total_steps, first_step))}"
    )


def status_line(row: dict, total_steps: int, first_step: int = 0) -> str:
    """``step 12/200 loss 4.1234 | 5210 tok/s 0.0982 s/step | 14s elapsed, eta 18s``"""
    eta = format_duration(eta_s(row, total_steps, first_step))
    return (
        f"step {row['step']}/{total_steps} loss {row['loss']:.4f} | "
        f"{row['tokens_per_s']:.0f} tok/s {row['step_time_s']:.3g} s/step | "
        f"{row['elapsed_s']:.0f}s elapsed, eta {eta}"
    )


def format_duration(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "-"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def summary_line(summary: dict, per: str = "gpu") -> str:
    """``done: 200 steps, final loss 1.5000, val loss 1.6000, 9000 tok/s, ...``; the
    validation loss is the last one evaluated, when there was one."""
    mfu = summary.get("mfu")
    mfu_text = f" mfu {mfu:.1%}" if mfu is not None else ""
    val_loss = summary.get("val_loss")
    val_text = f", val loss {val_loss:.4f}" if val_loss is not None else ""
    return (
        f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}{val_text}, "
        f"{summary['tokens_per_s']:.0f} tok/s, {summary['tflops_per_gpu']:.3g} TFLOP/s/{per}"
        f"{mfu_text}, {summary['elapsed_s']:.1f}s"
        + (" (stopped early, checkpoint saved)" if summary.get("stopped") else "")
    )


def gemm_tally(per_rank: dict[str, dict[str, str]]) -> dict[str, dict[str, int]]:
    """signature -> formulation -> how many ranks picked it."""
    tally: dict[str, dict[str, int]] = {}
    for picks in per_rank.values():
        for sig, name in picks.items():
            counts = tally.setdefault(sig, {})
            counts[name] = counts.get(name, 0) + 1
    return tally


def gemm_line(per_rank: dict[str, dict[str, str]], step: int) -> str:
    """``gemm tuning in step 1: 12 signatures on 4 ranks, picks: direct 40, transposed 8
    (each rank's in logs/rank_<N>.log)``"""
    totals: dict[str, int] = {}
    for counts in gemm_tally(per_rank).values():
        for name, n in counts.items():
            totals[name] = totals.get(name, 0) + n
    signatures = {sig for picks in per_rank.values() for sig in picks}
    picks = ", ".join(f"{name} {n}" for name, n in sorted(totals.items(), key=lambda kv: -kv[1]))
    return (
        f"gemm tuning in step {step}: {len(signatures)} signatures on {len(per_rank)} ranks, "
        f"picks: {picks} (each rank's in logs/rank_<N>.log)"
    )
