"""The callable submitit pickles and runs in every task of a Slurm job.

This module stays torch-free: the training core is imported only inside
``__call__``, on the compute node. Its signal handlers turn a time limit or preemption
(SIGUSR2) and a cancellation (SIGTERM) into a checkpoint at the next step boundary, then
a requeue or the end that signal would have caused.

How time limits, preemption, cancellation and chained jobs are handled:
``docs/recovery.md`` ("submit/task.py").
"""

from __future__ import annotations

import getpass
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from submitit.helpers import Checkpointable, DelayedSubmission

from axonn_launch.common.jobdir import JobPaths, attempt_number, checkpointed_step
from axonn_launch.common.ranks import environment_rank
from axonn_launch.scheduler.slurm import SLURM

REQUEUE_WAIT_S = 300  # how long ranks other than 0 wait to be stopped by the requeue


class TrainJob(Checkpointable):
    """Run the training core for the job directory ``job_dir`` (holding spec.json)."""

    def __init__(
        self, job_dir: str, task_env: dict[str, str] | None = None, chained: bool = False
    ) -> None:
        self.job_dir = job_dir
        self.task_env = dict(task_env or {})
        self.chained = chained

    def __call__(self) -> dict:
        submitit_handler = signal.getsignal(signal.SIGUSR2)
        stop = StopSignals()  # before the imports below: torch takes seconds to import
        apply_task_env(self.task_env, job_dir=self.job_dir)
        chained = getattr(self, "chained", False)  # a job pickled before chains existed
        rank = environment_rank(os.environ).rank
        if chained and rank == 0 and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
            set_requeueable(False)  # this allocation's node failure goes to the chain
        from axonn_launch.common.spec import JobSpec
        from axonn_launch.train import run_job
        from axonn_launch.train.health.faults import step_hook

        start, attempt = checkpointed_step(self.job_dir), attempt_number(self.job_dir)
        hook = step_hook(stop, rank=rank, start_step=start, attempt=attempt)
        spec = JobSpec.load(JobPaths(self.job_dir).spec)
        summary = run_job(spec, should_stop=hook)
        unfinished = summary.get("stopped") and summary["steps"] < spec.train.steps
        if unfinished and stop.cancelled(rank):
            end_by_sigterm(rank, summary["steps"])
        if unfinished and callable(submitit_handler):
            if chained and rank == 0:
                set_requeueable(True)
            hand_over_to_requeue(submitit_handler, rank)
        return summary

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """The submission to requeue: the same job; training state is in the checkpoints."""
        return DelayedSubmission(self, *args, **kwargs)


class StopSignals:
    """The ranks' ``should_stop``: true once SIGUSR2 or SIGTERM arrived. Its handler
    replaces submitit's for both and only notes which signal came."""

    SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: set[int] = set()
        for signum in self.SIGNALS:
            signal.signal(signum, self.request)

    def request(self, signum: int, frame: Any = None) -> None:
        self.received.add(signum)

    def __call__(self) -> bool:
        return bool(self.received)

    def cancelled(self, rank: int) -> bool:
        """Whether this rank is to end without a requeue: it got a TERM. A rank other
        than 0 that got USR2 first leaves that to rank 0, which requeues the job: the
        requeue's own TERM may reach it before its part of the stop is done."""
        if signal.SIGTERM not in self.received:
            return False
        return rank == 0 or signal.SIGUSR2 not in self.received


def end_by_sigterm(rank: int, step: int) -> None:
    """After the stop checkpoint of a SIGTERM: say so in one line, then end this process
    with the TERM's default action, as if no handler had delayed it. No requeue, and no
    submitit result: a job that only got the signal (``scancel --signal=TERM``) ends
    FAILED with its tasks terminated, never COMPLETED with steps left to train."""
    print(
        f"axonn_launch: rank {rank}: SIGTERM: stopped after step {step}, checkpoint saved;"
        " ending without a requeue",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(128 + signal.SIGTERM)  # not reached: the default action ends the process


def hand_over_to_requeue(submitit_handler: Any, rank: int) -> None:
    """After the stop checkpoint: rank 0 requeues (or raises when out of requeues).

    Other ranks wait to be ended by the requeue rather than return, so that no rank
    writes a "success" result for a job that is not finished.
    """
    submitit_handler(signal.SIGUSR2, None)
    if rank != 0:
        time.sleep(REQUEUE_WAIT_S)


def set_requeueable(requeueable: bool) -> None:
    """Let Slurm requeue this job (``scontrol requeue`` needs it) or not (a node failure
    then ends the job); a failure is logged: the job goes on either way."""
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return
    failed = SLURM.set_requeueable(job_id, requeueable)
    if failed:
        print(f"axonn_launch: {failed}", file=sys.stderr, flush=True)


def apply_task_env(task_env: dict[str, str], job_dir: str = "") -> None:
    """Per-task variables, expanded in Python (never by a shell): ``{user}``,
    ``{node_id}``, ``{local_rank}``, ``{rank}`` and ``{job_dir}``. A value under /tmp/
    is a folder, made here; a value in the job dir names a file or a file-name prefix (the
    Flight Recorder's ``.../logs/flight_recorder/rank_``), whose folder is made here."""
    where = environment_rank(os.environ)
    fields = {
        "user": os.environ.get("USER") or getpass.getuser(),
        "node_id": os.environ.get("SLURM_NODEID", "0"),
        "local_rank": str(where.local_rank),
        "rank": str(where.rank),
        "job_dir": job_dir,
    }
    for key, template in task_env.items():
        value = template.format(**fields)
        os.environ[key] = value
        if value.startswith("/tmp/"):
            Path(value).mkdir(parents=True, exist_ok=True)
        elif job_dir and "{job_dir}" in template:
            Path(value).parent.mkdir(parents=True, exist_ok=True)
