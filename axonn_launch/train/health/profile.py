"""``train.profile.steps=a-b``: torch.profiler over optimizer steps a to b on every rank.

Each rank starts the profiler when step a-1 ends (at once when a is the attempt's first
step) and stops it when step b ends, then writes ``profile/trace_rank<N>.json``, a Chrome
trace (Perfetto and chrome://tracing read it) with the CPU ops, the collectives' events
(``c10d::`` ops, gloo's and NCCL's own) and, on GPUs, the kernels. A window the run never
reaches writes nothing; one still open when the run ends is closed then. Design:
docs/job-side.md ("train/health/profile.py").
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from axonn_launch.common.jobdir import JobPaths
from axonn_launch.common.tracking import ProfileConfig

log = logging.getLogger(__name__)


class ProfileWindow:
    """The profiler of one rank over the configured window (does nothing when off)."""

    def __init__(self, cfg: ProfileConfig, job_dir: str | Path, *, rank: int,
                 device: torch.device, start_step: int) -> None:  # fmt: skip
        self.window = cfg.window()
        self.path = JobPaths(job_dir).profile_trace(rank)
        self.device, self.rank = device, rank
        self.profiler: profile | None = None
        if self.window and self.window[0] == start_step + 1:
            self.start()

    def step_done(self, step: int) -> None:
        """Called at the end of every optimizer step."""
        if not self.window:
            return
        if step == self.window[0] - 1:
            self.start()
        elif step == self.window[1]:
            self.stop()

    def start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities)
        self.profiler.start()

    def stop(self) -> None:
        """Write this rank's trace; a window still open at the end of training is closed."""
        if self.profiler is None:
            return
        self.profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.path))
        self.profiler = None
        if self.rank == 0:
            a, b = self.window or (0, 0)
            log.info("profile of steps %d-%d: %s (one per rank)", a, b, self.path)
