"""Submitting to Slurm through submitit, and following a job to its end."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from axonn_launch.job import TrainJob


def submit(*, folder: Path, params: dict[str, Any], job: TrainJob, max_requeue: int) -> Any:
    """Submit ``job`` with submitit's Slurm executor; returns the submitit Job."""
    import submitit

    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=max_requeue)
    executor.update_parameters(**params)
    return executor.submit(job)


def follow(job: Any, *, out=sys.stdout, poll_s: float = 1.0) -> str:
    """Stream the rank-0 log of ``job`` until it ends; returns its final Slurm state."""
    offset = 0
    while True:
        done = job.done(force_check=True)
        offset = _print_new(job.paths.stdout, offset, out)
        if done:
            _print_new(job.paths.stdout, offset, out)
            return job.state
        time.sleep(poll_s)


def _print_new(path: Path, offset: int, out) -> int:
    path = Path(str(path).replace("%t", "0"))
    if not path.exists():
        return offset
    with open(path, "rb") as handle:
        handle.seek(offset)
        chunk = handle.read()
    if chunk:
        out.write(chunk.decode(errors="replace"))
        out.flush()
    return offset + len(chunk)
