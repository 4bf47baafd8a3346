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


ACTIVE_STATES = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "RESIZING",
    "SUSPENDED",
    "STAGE_OUT",
}


def follow(job: Any, *, out=sys.stdout, poll_s: float = 1.0) -> str:
    """Stream the rank-0 log of ``job`` until Slurm says it ended; returns the final state.

    The state comes from sacct (through submitit). Without accounting it stays UNKNOWN:
    then the job counts as ended once every task has left its result file, and the state
    is read from those results (COMPLETED or FAILED).
    """
    offsets = {job.paths.stdout: 0, job.paths.stderr: 0}
    while True:
        offsets = {path: _print_new(path, offset, out) for path, offset in offsets.items()}
        state = job.get_info(mode="force").get("State", "UNKNOWN").split()[0]
        if state not in ACTIVE_STATES and state != "UNKNOWN":
            for path, offset in offsets.items():
                _print_new(path, offset, out)
            return state
        if state == "UNKNOWN" and _all_results_written(job):
            return _state_from_results(job)
        time.sleep(poll_s)


def _all_results_written(job: Any) -> bool:
    tasks = [job.task(k) for k in range(job.num_tasks)] if job.num_tasks > 1 else [job]
    return all(task.paths.result_pickle.exists() for task in tasks)


def _state_from_results(job: Any) -> str:
    try:
        job.results()
    except Exception:
        return "FAILED"
    return "COMPLETED"


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
