"""Per-step metrics: ``<job_dir>/metrics.jsonl`` (rank 0), a progress line, a summary.

Throughput follows AxoNN/Megatron: model FLOPs per token from Narayanan et al.'s formula
(``ModelSpec.flops_per_token``, counting the recompute forward when activation
checkpointing is on), times tokens per second, divided by the number of GPUs.
``mem_gb`` is in GiB (2**30 bytes), like ``axonn_launch.memory``.
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

from axonn_launch.models import ModelSpec

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


def memory_gib(device: torch.device) -> float:
    """Peak CUDA allocation on GPU; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux: KiB


class MetricsLogger:
    """Writes metrics on rank 0 only; other ranks get a logger that does nothing.

    The progress bar goes to ``stream`` (a terminal only); the summary line is logged."""

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
        stream: TextIO | None = None,
    ) -> None:
        self.flops_per_token = model.flops_per_token(seq_len, recompute=recompute)
        self.world_size = world_size
        self.peak = peak_tflops_per_gpu
        self.total_steps = total_steps
        self.device = device
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.progress = enabled and progress and self.stream.isatty()
        self.path = Path(job_dir) / "metrics.jsonl"
        self.start = time.perf_counter()
        self.last: dict | None = None
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
        self.last = row
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if self.progress:
                self.stream.write("\r" + progress_line(row, self.total_steps))
                self.stream.flush()
        return row

    def finish(self, summary: dict) -> None:
        if not self.enabled:
            return
        if self.progress:
            self.stream.write("\n")
            self.stream.flush()
        log.info(summary_line(summary))


def progress_line(row: dict, total_steps: int, width: int = 20) -> str:
    done = min(width, width * row["step"] // max(total_steps, 1))
    bar = "#" * done + "." * (width - done)
    return (
        f"[{bar}] {row['step']}/{total_steps} loss {row['loss']:.4f} "
        f"lr {row['lr']:.2e} {row['tokens_per_s']:.0f} tok/s "
        f"{row['tflops_per_gpu']:.3g} TFLOP/s/gpu {row['elapsed_s']:.0f}s"
    )


def summary_line(summary: dict) -> str:
    mfu = summary.get("mfu")
    mfu_text = f" mfu {mfu:.1%}" if mfu is not None else ""
    return (
        f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['tokens_per_s']:.0f} tok/s, {summary['tflops_per_gpu']:.3g} TFLOP/s/gpu"
        f"{mfu_text}, {summary['elapsed_s']:.1f}s"
        + (" (stopped early, checkpoint saved)" if summary.get("stopped") else "")
    )
