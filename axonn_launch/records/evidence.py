"""The evidence a job left for its failure class (``records/failures.py``'s ``classify``):
submitit's result pickles, the tails of its task logs (Slurm's files; ``logs/`` for
machine=local) with their NCCL warnings, the failure records of this attempt's ranks, and
what a local job's supervisor saw; also one ended srun step's (a restart in place).

Login-node code: never imports torch.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from axonn_launch.common.jobdir import (
    RANK_LOG,
    RECORD_TIME,
    SLURM_RESULT,
    SLURM_STDERR,
    SLURM_STDOUT,
    JobPaths,
    last_job_id,
    read_failures,
    read_summary,
)
from axonn_launch.records import failures
from axonn_launch.records.failures import Evidence
from axonn_launch.scheduler.slurm_queries import SchedulerInfo

LOG_TAIL_BYTES = 16384


def slurm_task_files(job_dir: Path, job_id: str) -> dict[str, dict[int, str]]:
    """``<job_dir>/slurm/<id>/<id>_<task>_<kind>`` as kind -> task -> path, one listing.

    Kinds: ``result.pkl``, ``log.out``, ``log.err``.
    """
    folder = JobPaths(job_dir).slurm_job(job_id)
    prefix = job_id + "_"
    files: dict[str, dict[int, str]] = {SLURM_RESULT: {}, SLURM_STDOUT: {}, SLURM_STDERR: {}}
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            task, _, kind = entry.name[len(prefix) :].partition("_")
            if entry.name.startswith(prefix) and kind in files and task.isdigit():
                files[kind][int(task)] = entry.path
    return files


def read_results(paths: dict[int, str]) -> tuple[tuple[str, str], ...]:
    """submitit result pickles: ("success", value) or ("error", traceback) per task."""
    results = []
    for task in sorted(paths):
        try:
            with open(paths[task], "rb") as handle:
                outcome, value = pickle.load(handle)
        except Exception as exc:  # unreadable or truncated: report, do not crash
            outcome, value = "error", f"unreadable result pickle {paths[task]}: {exc}"
        results.append((str(outcome), value if outcome == "error" else ""))
    return tuple(results)


def tail(path: Path | str, size: int = LOG_TAIL_BYTES, start: int = 0) -> str:
    """The last ``size`` bytes of a file, none from before byte ``start``."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(start, handle.tell() - size))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def log_sizes(job_dir: Path, job_id: str) -> dict[str, int]:
    """The size of each task log of a Slurm job now (path -> bytes): where the next step's
    lines begin (``step_evidence``)."""
    files = slurm_task_files(job_dir, job_id)
    paths = [*files[SLURM_STDOUT].values(), *files[SLURM_STDERR].values()]
    return {path: os.path.getsize(path) for path in paths if os.path.exists(path)}


def step_evidence(job_dir: Path, step: EndedStep) -> Evidence:
    """What is known about one ended srun step of a running Slurm job (a restart in place:
    ``submit/in_job.py``): its exit status, result pickles, the lines its tasks logged
    after ``step.offsets`` and its ranks' failure records since it began."""
    files = slurm_task_files(job_dir, step.job_id)
    logs = {t: tail(p, start=step.offsets.get(p, 0)) for t, p in files[SLURM_STDERR].items()}
    if 0 in files[SLURM_STDOUT]:
        out = files[SLURM_STDOUT][0]
        logs[0] = tail(out, start=step.offsets.get(out, 0)) + "\n" + logs.get(0, "")
    found = tuple(
        r for r in read_failures(job_dir) if _record_time(r) >= step.started - RECORD_CLOCK_SLACK_S
    )
    texts = ["\n".join([str(r.get("exception", "")), str(r.get("os_error", "")),
                        *r.get("tail", [])]) for r in found]  # fmt: skip
    return Evidence(
        exit_code=f"{step.exit_status}:0",
        results=read_results(files[SLURM_RESULT]),
        expected_results=len(step.nodes) * step.tasks_per_node,
        logs=logs,
        nodes=tuple(step.nodes),
        tasks_per_node=step.tasks_per_node,
        records=tuple(texts),
        failure_records=found,
    )


@dataclass(frozen=True)
class EndedStep:
    """An srun step of a running job that ended: its exit status, nodes, tasks per node,
    when it began and where its lines begin in each task log (``log_sizes``)."""

    job_id: str
    exit_status: int
    nodes: tuple[str, ...]
    tasks_per_node: int
    started: float
    offsets: dict[str, int] = field(default_factory=dict)


def task_logs(
    job_dir: Path, job_id: str, files: dict[str, dict[int, str]], every_task: bool = True
) -> dict[int, str]:
    """Tail of each task's stderr (tracebacks; srun and slurmstepd write into task 0's),
    and of task 0's stdout (Slurm: submitit's files; machine=local: logs/), each with the
    ``NCCL WARN`` lines of the task's NCCL log (where the preflight sent NCCL's output).

    ``every_task=False`` reads task 0 only: with the result pickles that settles most
    classes; the other tasks' logs matter to find the node of a collective error.
    """
    if job_id.startswith("local-"):
        logs = {0: tail(JobPaths(job_dir).console_log)}  # the console, then rank 0's own log
        for path in JobPaths(job_dir).logs.glob(RANK_LOG.format(rank="*")):
            rank = int(path.stem.split("_")[1])
            logs[rank] = "\n".join(filter(None, [logs.get(rank, ""), tail(path)]))
    else:
        errs = files[SLURM_STDERR] if every_task else {0: files[SLURM_STDERR].get(0, "")}
        logs = {task: tail(path) for task, path in errs.items() if path}
        if 0 in files[SLURM_STDOUT]:
            logs[0] = tail(files[SLURM_STDOUT][0]) + "\n" + logs.get(0, "")
    for task in logs:
        warned = nccl_warnings(job_dir, task)
        if warned:
            logs[task] += "\n" + warned
    return logs


def nccl_warnings(job_dir: Path, rank: int) -> str:
    """The ``NCCL WARN`` lines at the end of rank ``rank``'s NCCL log ("" without one)."""
    text = tail(JobPaths(job_dir).nccl_log(rank))
    return "\n".join(line for line in text.splitlines() if "NCCL WARN" in line)


def evidence(
    job_dir: Path, record: dict, info: SchedulerInfo | None, every_task: bool = False
) -> Evidence:
    job_id = last_job_id(record)
    state = info.state if info else ""
    expected = int(record.get("nodes", 1)) * int(record.get("tasks_per_node", 1))
    base = failures.base_state(state)
    if base in failures.ACTIVE_STATES:
        return Evidence(state=state, exit_code=info.exit_code if info else "")
    if base == "COMPLETED" and finished_by_itself(job_dir, record):
        return Evidence(state=state, exit_code=info.exit_code if info else "")
    if job_id.startswith("local-"):
        return local_evidence(job_dir, record, expected)
    nodelist = failures.expand_nodelist(info.nodelist if info else "")
    files = slurm_task_files(job_dir, job_id)
    results = read_results(files[SLURM_RESULT])
    succeeded = len(results) == expected and all(outcome == "success" for outcome, _ in results)
    if succeeded and base in ("", "UNKNOWN"):
        return Evidence(state=state, results=results, expected_results=expected)
    return Evidence(
        state=state,
        exit_code=info.exit_code if info else "",
        results=results,
        expected_results=expected,
        logs=task_logs(job_dir, job_id, files, every_task),
        nodes=nodelist,
        tasks_per_node=int(record.get("tasks_per_node", 1)),
        **record_evidence(job_dir, record),
    )


RECORD_CLOCK_SLACK_S = 5.0  # a rank's clock may run behind the launcher's


def attempt_failures(job_dir: Path, record: dict) -> tuple[dict, ...]:
    """The failure records this attempt's ranks left, oldest first (not an earlier
    attempt's in a reused job dir)."""
    since = attempt_start(record) - RECORD_CLOCK_SLACK_S
    return tuple(r for r in read_failures(job_dir) if _record_time(r) >= since)


def _record_time(record: dict) -> float:
    try:
        return float(record.get("time", 0.0))
    except (TypeError, ValueError):
        return 0.0


def record_evidence(job_dir: Path, record: dict) -> dict:
    """``Evidence``'s ``failure_records`` (this attempt's) and ``records``: where a full
    disk leaves its trace when the logs could not be written, the same records as text
    (``os_error``: the errno behind a failed checkpoint save) and the launcher's own
    failed record write (job.json's ``record_error``)."""
    found = attempt_failures(job_dir, record)
    texts = [
        "\n".join([str(r.get("exception", "")), str(r.get("os_error", "")), *r.get("tail", [])])
        for r in found
    ]
    if record.get("record_error"):
        texts.append(str(record["record_error"]))
    return {"records": tuple(texts), "failure_records": found}


def attempt_start(record: dict) -> float:
    """When the launch that job.json records began (0: unknown), so that the failure
    records an earlier attempt left in a reused job dir are not taken for this one's."""
    try:
        return datetime.strptime(str(record.get("submit_time")), RECORD_TIME).timestamp()
    except (ValueError, OverflowError):
        return 0.0


def local_evidence(job_dir: Path, record: dict, expected: int) -> Evidence:
    """machine=local: the supervisor's record (``batch/supervise.py``), then the logs.

    A job its supervisor stopped on a signal (the user's Ctrl-C or SIGTERM) is cancelled,
    as ``scancel`` is on Slurm. A rank killed by a signal is explained by its own log
    alone: its peers' lost connections are the symptom (what srun's "task N: Killed" line
    tells on Slurm)."""
    job_id = last_job_id(record)
    if local_state(record) == "RUNNING":
        return Evidence(state="RUNNING")
    status = record.get("status")  # a failed one is explained from its logs (diagnose)
    done = status == "completed" or (status != "failed" and finished_by_itself(job_dir, record))
    exit_code = str(record.get("exit_code", ""))
    if done:
        results = tuple(("success", "") for _ in range(expected))
        return Evidence(exit_code=exit_code, results=results)
    ended_by = supervisor_cause(record)
    if ended_by.get("rank") is None and ended_by.get("signal"):
        return Evidence(state=f"CANCELLED by {ended_by['signal']}", exit_code=exit_code)
    logs = task_logs(job_dir, job_id, {})
    for rank, text in failure_tails(job_dir, record).items():  # a waited job's tracebacks
        logs[rank] = "\n".join(filter(None, [logs.get(rank, ""), text]))
    if ended_by.get("signal"):
        logs = {ended_by["rank"]: logs.get(ended_by["rank"], "")}
    return Evidence(exit_code=exit_code, logs=logs, **record_evidence(job_dir, record))


def failure_tails(job_dir: Path, record: dict) -> dict[int, str]:
    """The traceback tail each rank of this attempt recorded as it died (rank -> text): a
    waited local job's rank 0 prints its traceback to the terminal only."""
    return {
        int(r["rank"]): "\n".join(str(line) for line in r.get("tail", []))
        for r in attempt_failures(job_dir, record)
        if isinstance(r.get("rank"), int)
    }


def supervisor_cause(record: dict) -> dict:
    """What ended a local job, as its supervisor saw it: ``rank`` (the rank that failed or was
    killed first), ``signal`` (that killed it, or that stopped the job), ``line``; {} if
    no supervisor said (a job that completed, or a record from before supervisors)."""
    found = record.get("ended_by") if last_job_id(record).startswith("local-") else None
    return found if isinstance(found, dict) else {}


def finished_by_itself(job_dir: Path, record: dict) -> bool:
    """The attempt's own word: rank 0 writes summary.json after the last step (also when
    nobody waited for the job, so job.json may still say "running")."""
    summary = read_summary(job_dir)
    return summary is not None and int(summary.get("steps", 0)) >= int(record.get("steps", 1))


def local_state(record: dict) -> str:
    """machine=local: the record's status, checking that a "running" job's process lives:
    ``local-<pid>`` names the job's supervisor (before supervisors: its rank 0)."""
    if record.get("status") != "running":
        return ""
    pid = int(last_job_id(record).split("-", 1)[1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass
    return "RUNNING" if runs_axonn_launch(pid) else ""


def runs_axonn_launch(pid: int) -> bool:
    """Whether process ``pid`` is one of ours, not another that reuses the number (True
    where /proc cannot tell)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return b"axonn_launch" in command
