"""Submitting to Slurm through submitit, and following a job to its end."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from axonn_launch.common import slurmtext
from axonn_launch.submit.render import relay_signals
from axonn_launch.submit.task import TrainJob

# sacct is asked at 1, 2, 4 ... s, then once a minute (submitit's own watcher backs off to
# a minute too); the log is streamed every STREAM_S seconds in between.
FIRST_CHECK_S, MAX_CHECK_S, STREAM_S = 1.0, 60.0, 1.0


def submit(
    *, folder: Path, params: dict[str, Any], job: TrainJob, max_requeue: int, python: str
) -> Any:
    """Submit ``job`` with submitit's Slurm executor; each task runs ``python``. The batch
    script is submitit's with its signals relayed to the ranks (``render.relay_signals``),
    the same text ``render.script_of`` gives for submission.sh."""
    import submitit

    class Executor(submitit.SlurmExecutor):
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return relay_signals(super()._make_submission_file_text(command, uid))

    executor = Executor(folder=folder, max_num_timeout=max_requeue, python=shlex.quote(python))
    executor.update_parameters(**params)
    return executor.submit(job)


def check_delays(first_s: float = FIRST_CHECK_S, max_s: float = MAX_CHECK_S) -> Iterator[float]:
    """Seconds between two sacct calls: ``first_s`` doubling up to ``max_s``, then flat."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * 2, max_s)


class Pacer:
    """When the next sacct call is due: at once, then after each of ``check_delays``."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self.restart()

    def restart(self) -> None:
        """Check at once and back off from the start again (the job is about to end)."""
        self._delays = check_delays()
        self._next = self._clock()

    def due(self) -> bool:
        return self._clock() >= self._next

    def checked(self) -> None:
        self._next = self._clock() + next(self._delays)


def follow(
    job: Any,
    *,
    out=sys.stdout,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    stream_s: float = STREAM_S,
) -> str:
    """Stream the rank-0 log of ``job`` until Slurm says it ended; returns the final state.

    The log is read every ``stream_s``; sacct (through submitit) only on the backing-off
    schedule of ``Pacer``, which starts over when every task has written its result. Without
    accounting the state stays UNKNOWN: then the job counts as ended once every task has
    left its result file, and the state is read from those results (COMPLETED or FAILED).
    """
    offsets = {job.paths.stdout: 0, job.paths.stderr: 0}
    pacer, results_written = Pacer(clock), False
    while True:
        offsets = {path: _print_new(path, offset, out) for path, offset in offsets.items()}
        if not results_written and _all_results_written(job):
            results_written = True
            pacer.restart()
        if pacer.due():
            state = slurmtext.base_state(job.get_info(mode="force").get("State", "")) or "UNKNOWN"
            pacer.checked()
            if state != "UNKNOWN" and not slurmtext.is_active(state):
                for path, offset in offsets.items():
                    _print_new(path, offset, out)
                return state
            if state == "UNKNOWN" and results_written:
                return _state_from_results(job)
        sleep(stream_s)


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
