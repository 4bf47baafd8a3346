"""Submitting to Slurm through submitit, and following a job to its end (the Slurm
scheduler's, ``slurm.py``). Login-node code: no torch."""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from axonn_launch.common import slurmtext
from axonn_launch.common.durations import duration
from axonn_launch.scheduler.slurm import SQUEUE

# sacct is asked at 1, 2, 4 ... s, then once a minute (submitit's own watcher backs off to
# a minute too); the log is streamed every STREAM_S seconds in between.
FIRST_CHECK_S, MAX_CHECK_S, STREAM_S = 1.0, 60.0, 1.0
# a job waiting in the queue says so at the first sacct check this long after its last
# line: about once a minute, as sacct is asked once a minute by then (``check_delays``)
PENDING_EVERY_S = 50.0
# squeue's reason before the scheduler looked at the job: it usually starts within seconds,
# so its first pending line waits for a real reason, or this long
UNSEEN_REASON, UNSEEN_FOR_S = "None", 5.0
SECOND_CTRL_C_S = 5.0  # a second Ctrl-C this soon after a detach stops the job


def submit(
    *,
    folder: Path,
    params: dict[str, Any],
    job: Callable[[], Any],
    max_requeue: int,
    python: str,
    script: Callable[[str], str] = str,
) -> Any:
    """Submit ``job`` with submitit's Slurm executor; each task runs ``python``. The batch
    script is ``script`` of submitit's (the launcher's: its log paths escaped and its
    signals relayed to the ranks, ``render.as_submitted``)."""
    import submitit

    class Executor(submitit.SlurmExecutor):
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return script(super()._make_submission_file_text(command, uid))

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
    With accounting unreachable, the state is squeue's (``Accounting``), said once.
    """
    pacer, queue = Pacer(clock), QueueLines(str(job.job_id), clock, out)
    with Accounting(str(job.job_id), out).quiet() as accounting:
        return _follow(job, accounting, pacer, queue, out, sleep, stream_s)


def _follow(job: Any, accounting: Accounting, pacer: Pacer, queue: QueueLines, out,
            sleep: Callable[[float], None], stream_s: float) -> str:  # fmt: skip
    offsets, results_written = {job.paths.stdout: 0, job.paths.stderr: 0}, False
    while True:
        offsets = {path: print_new(path, offset, out) for path, offset in offsets.items()}
        if not results_written and _all_results_written(job):
            results_written = True
            pacer.restart()
        if pacer.due():
            state = accounting.state(job, results_written)
            pacer.checked()
            queue.seen(state)
            if state != "UNKNOWN" and not slurmtext.is_active(state):
                for path, offset in offsets.items():
                    print_new(path, offset, out)
                return state
            if state == "UNKNOWN" and results_written:
                return _state_from_results(job)
        sleep(stream_s)


SACCT_ERROR = "Bypassing sacct error"  # submitit's warning, once per failed sacct call


class Accounting:
    """A followed job's state from sacct (through submitit) while accounting answers;
    while it does not, one line says so, submitit's warning (one per call, each in up to
    three formats) is kept off the console (``quiet``), and the state is squeue's: the
    job's while queued or running; once it left the queue, its results' (FAILED without)."""

    def __init__(self, job_id: str, out) -> None:
        self.job_id, self.out = job_id, out
        self.down = False
        self.errors = _SacctErrors()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[Accounting]:
        """submitit's sacct warnings are taken off its logger while inside."""
        submitit_log = logging.getLogger("submitit")
        submitit_log.addFilter(self.errors)
        try:
            yield self
        finally:
            submitit_log.removeFilter(self.errors)

    def state(self, job: Any, results_written: bool) -> str:
        """The job's state now: sacct's, else (said once) squeue's or its results'."""
        before = len(self.errors.said)
        info = job.get_info(mode="force")
        if len(self.errors.said) == before:
            self._say_once(False, "accounting answers again: job states are sacct's")
            return slurmtext.base_state(info.get("State", "")) or "UNKNOWN"
        self._say_once(True, f"accounting unreachable ({self.errors.said[-1]}): following job"
                             f" {self.job_id} through squeue and its result files")  # fmt: skip
        return queue_state(self.job_id, lambda: _state_from_results(job), results_written)

    def _say_once(self, down: bool, line: str) -> None:
        if down != self.down:
            self.down = down
            print(line, file=self.out, flush=True)


class _SacctErrors(logging.Filter):
    """Takes submitit's sacct warnings off its logger, keeping what each said."""

    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if SACCT_ERROR not in message:
            return True
        code = re.search(r"non-zero exit status (\d+)", message)
        said = message.split(SACCT_ERROR, 1)[1].rsplit(", status may be inaccurate", 1)[0]
        self.said.append(f"sacct exit status {code.group(1)}" if code else said.strip()[:160])
        return False


def queue_state(job_id: str, from_results: Callable[[], str], results_written: bool) -> str:
    """squeue's state of a job (UNKNOWN when squeue fails too); once it left the queue, its
    results' state, or FAILED when its tasks left none."""
    try:
        done = subprocess.run([SQUEUE, "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                              text=True, timeout=60, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "UNKNOWN"
    if done.returncode == 0 and done.stdout.strip():
        return slurmtext.base_state(done.stdout.split()[0]) or "UNKNOWN"
    if done.returncode != 0 and "Invalid job id" not in done.stderr:  # squeue failed too
        return "UNKNOWN"
    return from_results() if results_written else "FAILED"  # it left the queue


class QueueLines:
    """While a followed job waits in the queue, one line with squeue's reason and the time
    waited so far: at once (once the scheduler gave a reason), then about every
    ``PENDING_EVERY_S``; and one when it starts, if it waited visibly."""

    def __init__(
        self,
        job_id: str,
        clock: Callable[[], float],
        out,
        reason: Callable[[str], str] | None = None,
        every_s: float = PENDING_EVERY_S,
    ) -> None:
        self.job_id, self.clock, self.out, self.every_s = job_id, clock, out, every_s
        self.reason = reason or pending_reason
        self.began = clock()
        self.said: float | None = None  # when the last pending line was printed
        self.started = False

    def seen(self, state: str) -> None:
        """The state sacct just gave; prints what is due."""
        waited = self.clock() - self.began
        if state != "PENDING":
            if self.said is not None and not self.started:
                self.started = True
                self._print(f"job {self.job_id} {state.lower()} after {duration(waited)} queued")
            return
        if self.said is not None and self.clock() - self.said < self.every_s:
            return
        why = self.reason(self.job_id)
        if self.said is None and why in ("", UNSEEN_REASON) and waited < UNSEEN_FOR_S:
            return
        self.said = self.clock()
        because = f" ({why})" if why else ""
        self._print(f"job {self.job_id} pending{because}: {duration(waited)} in the queue so far")

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)


def pending_reason(job_id: str) -> str:
    """squeue's reason (``%r``) for a pending job, e.g. Priority or Resources; "" if
    squeue does not say."""
    try:
        done = subprocess.run(
            [SQUEUE, "-h", "-j", job_id, "-o", "%r"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""


class SecondCtrlC:
    """While inside (after a Ctrl-C that detached), a Ctrl-C is noted, never raised: no
    traceback, however soon it comes."""

    def __enter__(self) -> SecondCtrlC:
        self.came = False
        self.previous = signal.signal(signal.SIGINT, self.note)
        return self

    def note(self, _signum: int, _frame: Any) -> None:
        self.came = True

    def __exit__(self, *_: object) -> None:
        signal.signal(signal.SIGINT, self.previous)

    def within(
        self,
        window_s: float = SECOND_CTRL_C_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> bool:
        """Whether a Ctrl-C came (or comes) within ``window_s``."""
        deadline = clock() + window_s
        while not self.came and clock() < deadline:
            sleep(0.05)
        return self.came


def _all_results_written(job: Any) -> bool:
    tasks = [job.task(k) for k in range(job.num_tasks)] if job.num_tasks > 1 else [job]
    return all(task.paths.result_pickle.exists() for task in tasks)


def _state_from_results(job: Any) -> str:
    try:
        job.results()
    except Exception:
        return "FAILED"
    return "COMPLETED"


def print_new(path: Path, offset: int, out) -> int:
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
