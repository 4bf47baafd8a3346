"""Which log files a job's ranks left, for ``jobs logs``: by rank, by node, or the rank
that failed first.

Every rank's logger writes ``logs/rank_<N>.log`` (common/jobdir.py); on machine=local a
rank past 0 also sends its stdout and stderr there, and rank 0's console of a detached
job is ``axonn_launch.log``. On Slurm, submitit's ``slurm/<id>/<id>_<task>_log.{out,err}``
hold each task's (rank's) stdout and stderr. The failing rank is the one ``jobs status``
names (records/status.py ``shown_reason``): the rank the local supervisor saw killed, else
the first rank that raised and was not only a lost peer's symptom (records/firstfail.py),
else the first rank on a node the job lost (a node failure leaves no record of its own: its
ranks are gone; the attempt's ``bad_nodes``, which ``jobs status`` and the restart read),
else the task srun reported killed. Login-node code: never imports torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from axonn_launch.common.failure_classes import NODE_FAILURE
from axonn_launch.common.jobdir import (
    RANK_LOG,
    SLURM_STDERR,
    SLURM_STDOUT,
    JobPaths,
    last_job_id,
    read_failures,
    read_record_or_empty,
    run_root,
)
from axonn_launch.records.evidence import slurm_task_files, supervisor_cause, tail
from axonn_launch.records.failures import KILLED_TASK
from axonn_launch.records.firstfail import is_symptom

HOST = re.compile(r" rank \d+ host (\S+) ")  # train/logs.py's FORMAT


class LogsError(ValueError):
    """No log answers the question (no such rank, no failed rank): one line, exit 2."""


def is_slurm_job(record: dict) -> bool:
    job_id = last_job_id(record)
    return bool(job_id) and not job_id.startswith("local-")


def rank_logs(job_dir: Path, record: dict, rank: int) -> list[Path]:
    """Rank ``rank``'s log files that exist: Slurm's stdout and stderr of its task, or rank
    0's console on machine=local; then its own log."""
    paths, found = JobPaths(job_dir), []
    if is_slurm_job(record):
        files = slurm_task_files(job_dir, last_job_id(record))
        found += [Path(files[kind][rank]) for kind in (SLURM_STDOUT, SLURM_STDERR)
                  if rank in files[kind]]  # fmt: skip
    elif rank == 0:
        found.append(paths.console_log)
    found.append(paths.rank_log(rank))
    return [path for path in found if path.is_file()]


def logged_ranks(job_dir: Path) -> dict[int, Path]:
    """rank -> its own log, for every rank that has one."""
    found = {}
    for path in JobPaths(job_dir).logs.glob(RANK_LOG.format(rank="*")):
        rank = path.stem.rpartition("_")[2]
        if rank.isdigit():
            found[int(rank)] = path
    return found


def ranks_with_logs(job_dir: Path, record: dict) -> list[int]:
    ranks = set(logged_ranks(job_dir))
    if is_slurm_job(record):
        files = slurm_task_files(job_dir, last_job_id(record))
        ranks |= set(files[SLURM_STDOUT]) | set(files[SLURM_STDERR])
    return sorted(ranks)


def host_of(log: Path) -> str:
    """The host a rank log's first formatted line names ("" if none yet)."""
    with log.open(errors="replace") as handle:
        for line in handle:
            found = HOST.search(line)
            if found:
                return found.group(1)
    return ""


def ranks_on_node(job_dir: Path, node: str) -> list[int]:
    """The ranks whose own log says they ran on ``node``."""
    return sorted(rank for rank, log in logged_ranks(job_dir).items() if host_of(log) == node)


def failed_rank(job_dir: Path, record: dict) -> int | None:
    """The rank that failed first, as ``jobs status`` finds it; None when none failed."""
    cause = supervisor_cause(record)
    if isinstance(cause.get("rank"), int):
        return cause["rank"]
    records = [r for r in read_failures(job_dir) if isinstance(r.get("rank"), int)]
    causes = [r for r in records if not is_symptom(r)]
    if causes:
        return causes[0]["rank"]
    lost = lost_node_rank(job_dir, record)
    if lost is not None:
        return lost
    killed = killed_task(job_dir, record)
    if killed is not None:
        return killed
    return records[0]["rank"] if records else None


def lost_node_rank(job_dir: Path, record: dict) -> int | None:
    """The first rank whose log says it ran on a node that an attempt of this job dir lost
    (the run's chain: ``bad_nodes`` of a ``node_failure``, in place or not)."""
    here = Path(job_dir).resolve()
    chain = read_record_or_empty(run_root(job_dir, record)).get("chain") or {}
    for attempt in chain.get("attempts") or []:
        if attempt.get("class") != NODE_FAILURE or not attempt.get("job_dir"):
            continue
        if Path(attempt["job_dir"]).resolve() != here:
            continue
        for node in attempt.get("bad_nodes") or []:
            ranks = ranks_on_node(job_dir, node)
            if ranks:
                return ranks[0]
    return None


def killed_task(job_dir: Path, record: dict) -> int | None:
    """The first task srun reported killed (``srun: error: n2: task 1: Killed``)."""
    if not is_slurm_job(record):
        return None
    files = slurm_task_files(job_dir, last_job_id(record))
    for path in files[SLURM_STDERR].values():
        found = KILLED_TASK.search(tail(path))
        if found:
            return int(re.split(r"[,-]", found.group("tasks"))[0])
    return None
