"""A run's goodput in its TensorBoard folder, beside its curves: once every attempt has
ended, the parts of the allocated time (``records/goodput.py``), the queue, the node-hours
and the goodput itself, at the run's last step, under ``goodput/``. The job's own side
writes them when the run ends (a local run's supervisor: ``batch/supervise.py``), and
``jobs status`` the first time it finds the run ended without them (the scheduler's times
are known only then), and again if the run was extended since. Login-node code:
tensorboard's own event writer, never torch; a failure to write is one line and never
stops the job's end or ``jobs status``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from axonn_launch.common.jobdir import JobPaths
from axonn_launch.records.goodput import PARTS
from axonn_launch.records.runs import runs
from axonn_launch.records.status import JobStatus, collect

TAGS = ("goodput", *(f"{part}_s" for part in PARTS), "queue_s", "node_hours")


def log_ended_runs(rows: list[JobStatus]) -> list[str]:
    """Each ended run's goodput (``records/runs.runs``' rows) into its TensorBoard
    folder, once; the lines saying why one was not written."""
    said = (log_goodput(Path(r.run_dir or r.job_dir), r.goodput, r.step) for r in rows
            if r.goodput and r.step)  # fmt: skip
    return [line for line in said if line]


def log_run_at_end(attempt_dirs: list[Path]) -> list[str]:
    """The job side, when its run ended: the goodput of the run whose attempts are
    ``attempt_dirs`` (nothing while one of them has not ended)."""
    return log_ended_runs(runs(collect([str(d) for d in attempt_dirs])))


def log_goodput(root: Path, found: dict, step: int) -> str:
    """Write ``found`` (a run's goodput) at ``step`` into the run's TensorBoard folder, unless
    it holds it already; '' when written or nothing to do, else why not (one line)."""
    paths = JobPaths(root)
    if not paths.tensorboard.is_dir() or logged_step(paths) >= step:
        return ""
    try:
        write_scalars(paths.tensorboard, {f"goodput/{t}": float(found[t]) for t in TAGS
                                          if t in found}, step)  # fmt: skip
        paths.goodput_logged.write_text(json.dumps({"step": step, **found}, indent=2) + "\n")
    except (OSError, ImportError, ValueError) as error:
        return f"goodput not written to {paths.tensorboard}: {type(error).__name__}: {error}"
    return ""


def logged_step(paths: JobPaths) -> int:
    """The step whose goodput the folder holds (0: none)."""
    try:
        return int(json.loads(paths.goodput_logged.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def write_scalars(folder: Path, values: dict[str, float], step: int) -> None:
    """One event file of its own in ``folder`` holding ``values`` at ``step``."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    summary = summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()]
    )
    writer = EventFileWriter(str(folder), filename_suffix=".goodput")
    writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
    writer.close()
