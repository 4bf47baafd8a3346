"""``train.profile.steps=a-b``: torch.profiler over optimizer steps a to b on every rank.

Each rank starts the profiler when step a-1 ends (at once when a is the attempt's first
step) and stops it when step b ends, then writes ``profile/trace_rank<N>.json``, a Chrome
trace (Perfetto and chrome://tracing read it) with the CPU ops, the collectives' events
(``c10d::`` ops, gloo's and NCCL's own) and, on GPUs, the kernels. A window the run never
reaches writes nothing; one still open when the run ends is closed then. With
``train.profile.memory=true`` each rank also writes ``profile/memory_rank<N>.json`` when the
window ends: its RSS and PSS (``/proc/self/smaps_rollup``) and peak RSS, and on GPUs the
allocator's peaks and a CUDA memory snapshot of the window (``memory_rank<N>.pickle``, for
pytorch.org/memory_viz), dumped too, as ``memory_rank<N>_oom.pickle``, when the run fails
out of memory. Design: docs/job-side.md ("train/health/profile.py").
"""

from __future__ import annotations

import json
import logging
import resource
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
        self.memory = cfg.memory
        self.paths = JobPaths(job_dir)
        self.path = self.paths.profile_trace(rank)
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
        if self.memory and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def stop(self) -> None:
        """Write this rank's trace; a window still open at the end of training is closed."""
        if self.profiler is None:
            return
        self.profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.path))
        self.profiler = None
        if self.memory:
            self.write_memory()
        if self.rank == 0:
            a, b = self.window or (0, 0)
            log.info("profile of steps %d-%d: %s (one per rank)", a, b, self.path)

    def write_memory(self) -> None:
        """This rank's memory at the window's end (and the window's CUDA snapshot)."""
        found = {"rank": self.rank, **host_memory()}
        if self.device.type == "cuda":
            snapshot = self.paths.profile_snapshot(self.rank)
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            found.update(
                max_allocated_bytes=torch.cuda.max_memory_allocated(self.device),
                max_reserved_bytes=torch.cuda.max_memory_reserved(self.device),
                snapshot=snapshot.name,
            )
        self.paths.profile_memory(self.rank).write_text(json.dumps(found, indent=2) + "\n")

    def failed(self, error: BaseException) -> None:
        """A run that failed: an out-of-memory error inside a recorded window leaves its
        snapshot (what was allocated, and where, when it ran out)."""
        recording = self.memory and self.profiler is not None and self.device.type == "cuda"
        if recording and isinstance(error, torch.OutOfMemoryError):
            path = self.paths.profile_snapshot(self.rank, "_oom")
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            log.error("out of memory: CUDA memory snapshot in %s", path)


def host_memory() -> dict[str, int]:
    """This process's resident and proportional set sizes and its peak RSS, in bytes (PSS
    shares each page among the processes that map it: the ranks of a node add up)."""
    found = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError:  # not Linux: the peak only
        return found
    fields = {"Rss:": "rss_bytes", "Pss:": "pss_bytes"}
    for line in lines:
        key, *value = line.split()
        if key in fields and value:
            found[fields[key]] = int(value[0]) * 1024  # kB
    return found
