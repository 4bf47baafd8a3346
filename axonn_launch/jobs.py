"""``python -m axonn_launch.jobs status|resubmit``: what happened to my jobs, and bring back
the ones worth bringing back.

``status [PATH...] [--json]``: one row per job directory (a folder holding ``job.json``,
found anywhere under each PATH; default ``jobs/``): job id, name, machine, model, grid,
nodes, state, step reached / total (``metrics.jsonl``), last loss, failure class
(``axonn_launch.records.failures``) and attempts; under the table, why each failed job failed and
the slow nodes the preflight named (``axonn_launch.train.preflight``; a job it stopped
counts as a node failure of those nodes). States come from one batched ``sacct`` call for
all jobs; without accounting, from ``squeue`` for queued jobs and from submitit's result
pickles and the logs for ended ones.

``resubmit [PATH...] [--dry-run] [--only CLASS...] [--max-attempts N] [KEY=VALUE...]``:
for each failed job whose class allows it, submit a new attempt in a sibling directory
``<job_dir>_attempt<N>`` that starts from a hard-linked copy of the latest checkpoint,
with the job's original overrides plus the given ones (validated like any launch), and
``--exclude`` for the nodes a node or collective failure points at and for the slow nodes
its preflight named. Both records are
updated: the old one gets ``resubmitted_as``, the new one ``attempt``, ``parent`` and
``lineage``. A per-job lock and the ``resubmitted_as`` mark, written before submitting,
make it idempotent: a job that is completed, still queued or running, or already
resubmitted is never submitted again, also when two commands run at once.

Login-node code: never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from axonn_launch.common import slurmtext
from axonn_launch.records import failures, firstfail
from axonn_launch.records.failures import Diagnosis, Evidence
from axonn_launch.usage import run_tool

DEFAULT_ROOT = "jobs"
SKIP_DIRS = frozenset({"slurm", "checkpoints", "logs", ".hydra", ".submitit"})
LOG_TAIL_BYTES = 16384
RETRIABLE = (failures.RESUME, failures.RESUME_EXCLUDING)
# overrides that change what a job needs per GPU: with one, an out-of-memory job may retry
RESHAPING_KEYS = ("grid", "nodes", "train.micro_batch", "train.activation_checkpointing")
EXCLUDE_KEY = "+machine.slurm.extra_sbatch.exclude"
NODE_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")  # what may go into --exclude
PREFLIGHT_FILE = "preflight.json"  # rank 0 of the job writes it (train/preflight.py)
PREFLIGHT_EXPECTED_FILE = "preflight_expected.json"  # the launcher writes it, the job reads it


@dataclass(frozen=True)
class SchedulerInfo:
    state: str = ""
    exit_code: str = ""
    nodelist: str = ""


@dataclass
class JobStatus:
    job_dir: str
    job_id: str
    name: str
    machine: str
    model: str
    grid: str
    nodes: int
    state: str
    step: int | None
    steps: int
    loss: float | None
    tokens_per_s: float | None
    step_time_s: float | None
    failure: str
    action: str
    reason: str
    attempt: int
    bad_nodes: list[str] = field(default_factory=list)
    resubmitted_as: str = ""
    slow_nodes: list[str] = field(default_factory=list)  # named by this attempt's preflight
    # what ran after the training (sample, memorization): "done", "failed: ..." or "pending"
    after_training: dict[str, str] = field(default_factory=dict)


# --- finding and reading job directories -------------------------------------------------


JOB_DIR_HINT = (
    "a job dir is the folder one launch writes, holding job.json"
    " (python -m axonn_launch makes jobs/<name>/<time>/)"
)


class NotAJobPath(ValueError):
    """A PATH argument with no job dir at or below it; the message says what one is."""


def find_job_dirs(paths: list[str]) -> list[Path]:
    """Every directory holding a job.json at or below ``paths``, in a stable order.

    Raises NotAJobPath for a path with none: a typo must not look like "nothing to do".
    """
    found: list[Path] = []
    for path in paths:
        here: list[Path] = []
        _walk(Path(path), here)
        if not here:
            what = "holds no job dir" if os.path.exists(path) else "no such file or directory"
            raise NotAJobPath(f"{path}: {what}; {JOB_DIR_HINT}")
        found += here
    return sorted(set(found))


def _walk(path: Path, found: list[Path]) -> None:
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return
    if any(e.name == "job.json" for e in entries):
        found.append(path)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and entry.name not in SKIP_DIRS:
            _walk(Path(entry.path), found)


def read_record(job_dir: Path) -> dict:
    return json.loads((job_dir / "job.json").read_text())


def read_summary(job_dir: Path | str) -> dict | None:
    """``summary.json``, which rank 0 writes when the run ends; None before (or unreadable)."""
    try:
        summary = json.loads((Path(job_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


DRY_RUN_STATE = "DRY_RUN"
DRY_RUN_WORDS = "is a dry run: nothing was trained; launch it without dry_run=true"


def is_dry_run(record: dict) -> bool:
    """The launch only rendered and recorded the job (``dry_run=true``): nothing ran."""
    return bool(record.get("dry_run")) or record.get("status") == "dry_run"


def dry_run_problem(job_dir: Path | str) -> str | None:
    """The one line for a tool asked for what only a run makes (report, generate), or None."""
    try:
        record = read_record(Path(job_dir))
    except (OSError, ValueError):
        return None
    if not is_dry_run(record):
        return None
    return f"{job_dir}: {DRY_RUN_WORDS}"


def last_metrics(job_dir: Path) -> dict | None:
    """The last row of metrics.jsonl, reading only the end of the file."""
    path = job_dir / "metrics.jsonl"
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 4096))
            tail = handle.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        with contextlib.suppress(ValueError):
            return json.loads(line)
    return None


@dataclass(frozen=True)
class RunResults:
    """Loss and speed of a run: its summary once it finished, else its last step."""

    loss: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None


def run_results(job_dir: Path, metrics: dict | None = None) -> RunResults:
    """From summary.json, else from ``metrics`` (the last step's row, read if not given)."""
    summary = read_summary(job_dir)
    if summary is None:
        row = metrics if metrics is not None else last_metrics(Path(job_dir)) or {}
        summary = {"final_loss": row.get("loss"), **row}
    values = [summary.get(k) for k in ("final_loss", "tokens_per_s", "step_time_s")]
    return RunResults(*(_finite(v) for v in values))


def _finite(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def current_job_id(record: dict) -> str:
    ids = record.get("job_ids") or []
    return str(ids[-1]) if ids else ""


def preflight_of(job_dir: Path, record: dict) -> dict | None:
    """The preflight verdict of the job ``record`` names now: job.json's, else the job's
    own ``preflight.json`` (written a moment before job.json could be); None for another
    job's (a reused job dir) or none at all."""
    job_id = current_job_id(record)
    found = record.get("preflight")
    if not (isinstance(found, dict) and found.get("job_id") == job_id):
        try:
            found = json.loads((Path(job_dir) / PREFLIGHT_FILE).read_text())
        except (OSError, ValueError):
            return None
    return found if isinstance(found, dict) and job_id and found.get("job_id") == job_id else None


def slow_nodes_of(preflight: dict | None) -> list[str]:
    """The preflight's slow nodes that are plain node names (they go into --exclude)."""
    nodes = (preflight or {}).get("slow_nodes") or []
    return [str(n) for n in nodes if NODE_NAME.fullmatch(str(n))]


# --- the scheduler's view ------------------------------------------------------------------


def scheduler_states(job_ids: list[str]) -> dict[str, SchedulerInfo]:
    """State of every Slurm job in ``job_ids``: one sacct call, or squeue without accounting."""
    ids = sorted({j for j in job_ids if j and not j.startswith("local-")})
    if not ids:
        return {}
    states = sacct_states(ids)
    return states if states is not None else squeue_states(ids)


def sacct_states(job_ids: list[str]) -> dict[str, SchedulerInfo] | None:
    """None when sacct is missing or fails (no accounting)."""
    out = _run(slurmtext.sacct_command(job_ids))
    if out is None:
        return None
    rows = slurmtext.parse_sacct(out)
    return {job: SchedulerInfo(r.state, r.exit_code, r.nodelist) for job, r in rows.items()}


def squeue_states(job_ids: list[str]) -> dict[str, SchedulerInfo]:
    """Queued and running jobs only; a job squeue does not list has ended."""
    rows = slurmtext.parse_squeue(_run(slurmtext.squeue_command()) or "")
    wanted = set(job_ids)
    return {job: SchedulerInfo(r.state, "", r.nodelist) for job, r in rows.items() if job in wanted}


def _run(command: list[str]) -> str | None:
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


# --- evidence from the job directory -------------------------------------------------------


def slurm_task_files(job_dir: Path, job_id: str) -> dict[str, dict[int, str]]:
    """``<job_dir>/slurm/<id>/<id>_<task>_<kind>`` as kind -> task -> path, one listing.

    Kinds: ``result.pkl``, ``log.out``, ``log.err``.
    """
    folder = os.path.join(job_dir, "slurm", job_id)
    prefix = job_id + "_"
    files: dict[str, dict[int, str]] = {"result.pkl": {}, "log.out": {}, "log.err": {}}
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


def tail(path: Path | str, size: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - size))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


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
        logs = {0: tail(job_dir / "axonn_launch.log")}
        for path in (job_dir / "logs").glob("rank_*.log"):
            logs[int(path.stem.split("_")[1])] = tail(path)
    else:
        errs = files["log.err"] if every_task else {0: files["log.err"].get(0, "")}
        logs = {task: tail(path) for task, path in errs.items() if path}
        if 0 in files["log.out"]:
            logs[0] = tail(files["log.out"][0]) + "\n" + logs.get(0, "")
    for task in logs:
        warned = nccl_warnings(job_dir, task)
        if warned:
            logs[task] += "\n" + warned
    return logs


NCCL_LOG_NAME = "nccl_rank{rank}.log"  # in <job_dir>/logs/; NCCL_DEBUG_FILE (train/startup.py)


def nccl_warnings(job_dir: Path, rank: int) -> str:
    """The ``NCCL WARN`` lines at the end of rank ``rank``'s NCCL log ("" without one)."""
    text = tail(Path(job_dir) / "logs" / NCCL_LOG_NAME.format(rank=rank))
    return "\n".join(line for line in text.splitlines() if "NCCL WARN" in line)


def evidence(
    job_dir: Path, record: dict, info: SchedulerInfo | None, every_task: bool = False
) -> Evidence:
    job_id = current_job_id(record)
    state = info.state if info else ""
    expected = int(record.get("nodes", 1)) * int(record.get("tasks_per_node", 1))
    base = failures.base_state(state)
    if base in failures.ACTIVE_STATES:
        return Evidence(state=state, exit_code=info.exit_code if info else "")
    if base == "COMPLETED" and finished_by_itself(job_dir, record):
        return Evidence(state=state, exit_code=info.exit_code if info else "")
    if job_id.startswith("local-"):
        state = local_state(record)
        if state == "RUNNING":
            return Evidence(state=state)
        results: tuple[tuple[str, str], ...] = ()
        status = record.get("status")  # a failed one is explained from its logs (diagnose)
        done = status == "completed" or (status != "failed" and finished_by_itself(job_dir, record))
        if done:
            results = tuple(("success", "") for _ in range(expected))
        exit_code = str(record.get("exit_code", ""))
        logs = {} if done else task_logs(job_dir, job_id, {})
        return Evidence(state="", exit_code=exit_code, results=results, logs=logs)
    nodelist = failures.expand_nodelist(info.nodelist if info else "")
    files = slurm_task_files(job_dir, job_id)
    results = read_results(files["result.pkl"])
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
    )


def finished_by_itself(job_dir: Path, record: dict) -> bool:
    """The attempt's own word: rank 0 writes summary.json after the last step (also when
    nobody waited for the job, so job.json may still say "running")."""
    summary = read_summary(job_dir)
    return summary is not None and int(summary.get("steps", 0)) >= int(record.get("steps", 1))


def settled_status(record: dict, info: SchedulerInfo | None, row: JobStatus) -> str | None:
    """What job.json should now say of a job it still calls running or submitted, once the
    end is certain: the job's own results, a dead local process, or sacct's final state.
    A "failed" job whose training had finished is "completed" (what failed came after it)."""
    if record.get("status") == "failed" and row.failure == failures.COMPLETED:
        return "completed"
    if record.get("status") not in ("running", "submitted") or row.failure == failures.RUNNING:
        return None
    if row.failure == failures.COMPLETED:
        return "completed"
    ended = current_job_id(record).startswith("local-") or bool(info and info.state)
    return "failed" if ended else None


def local_state(record: dict) -> str:
    """machine=local: the record's status, checking that a "running" job's process lives."""
    if record.get("status") != "running":
        return ""
    pid = int(current_job_id(record).split("-", 1)[1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass
    return "RUNNING"


def diagnose(
    job_dir: Path, record: dict, info: SchedulerInfo | None, preflight: dict | None
) -> tuple[str, Diagnosis]:
    """(state to show, diagnosis) of one job; ``preflight``: its verdict (``preflight_of``).

    A job whose training finished (its summary.json has every step) is COMPLETED whatever
    failed after it (a sample, an export: ``after_training`` in the summary says what)."""
    if record.get("status") == "refused":
        return "REFUSED", Diagnosis(failures.UNKNOWN, f"sbatch refused it: {record.get('error')}")
    if not current_job_id(record):
        return "NOT_SUBMITTED", Diagnosis(failures.UNKNOWN, "no job id in job.json")
    ev = evidence(job_dir, record, info)
    diagnosis = failures.classify(ev)
    if diagnosis.failure in (failures.COLLECTIVE_FAILURE, failures.UNKNOWN):
        ev = evidence(job_dir, record, info, every_task=True)
        diagnosis = failures.classify(ev)
    if diagnosis.failure not in (failures.COMPLETED, failures.RUNNING):
        first = firstfail.first_failure(job_dir)
        if first is not None:  # the rank that failed first says why, in its own words
            diagnosis = replace(diagnosis, reason=firstfail.headline(first))
        if finished_by_itself(job_dir, record):  # what failed came after the training
            why = f"training finished, then the job ended ({diagnosis.failure}): {diagnosis.reason}"
            return "COMPLETED", Diagnosis(failures.COMPLETED, why)
    stopped = preflight_stop(preflight, diagnosis)
    shown = ev.state or _state_from_class(diagnosis.failure)
    return shown, stopped or diagnosis


def preflight_stop(preflight: dict | None, diagnosis: Diagnosis) -> Diagnosis | None:
    """A failed job that its preflight stopped for slow nodes: a node failure of those
    nodes (resume without them), whatever its ranks' PreflightError looks like in the logs."""
    slow = slow_nodes_of(preflight)
    if not slow or not (preflight or {}).get("stopped"):
        return None
    if diagnosis.failure in (failures.COMPLETED, failures.RUNNING):
        return None
    why = preflight.get("slow_reason") or f"slow nodes {', '.join(slow)}"
    reason = f"preflight stopped the job: {why}"
    return Diagnosis(failures.NODE_FAILURE, reason, tuple(slow))


def _state_from_class(failure: str) -> str:
    if failure == failures.COMPLETED:
        return "COMPLETED"
    return "RUNNING" if failure == failures.RUNNING else "ENDED"


def job_status(
    job_dir: Path, record: dict, info: SchedulerInfo | None, preflight: dict | None
) -> JobStatus:
    if is_dry_run(record):  # its own state: no failure class, nothing to do about it
        state, diagnosis = DRY_RUN_STATE, None
    else:
        state, diagnosis = diagnose(job_dir, record, info, preflight)
    metrics = last_metrics(job_dir)
    results = run_results(job_dir, metrics)
    grid = record.get("grid") or {}
    return JobStatus(
        job_dir=str(job_dir),
        job_id=current_job_id(record),
        name=str(record.get("name", "")),
        machine=str(record.get("machine", "")),
        model=str(record.get("model", "")),
        grid=" ".join(f"{a}={grid[a]}" for a in ("data", "x", "y", "z") if a in grid),
        nodes=int(record.get("nodes", 0)),
        state=state,
        step=int(metrics["step"]) if metrics else None,
        steps=int(record.get("steps", 0)),
        loss=results.loss,
        tokens_per_s=results.tokens_per_s,
        step_time_s=results.step_time_s,
        failure=diagnosis.failure if diagnosis else "",
        action=diagnosis.action if diagnosis else "",
        reason=diagnosis.reason[:300] if diagnosis else "dry run: never submitted",
        attempt=int(record.get("attempt", 1)),
        bad_nodes=list(diagnosis.bad_nodes) if diagnosis else [],
        resubmitted_as=str(record.get("resubmitted_as", "")),
        slow_nodes=slow_nodes_of(preflight),
        after_training=after_training_of(job_dir),
    )


def after_training_of(job_dir: Path) -> dict[str, str]:
    """summary.json's ``after_training``: step -> "done", "failed: ..." or "pending"."""
    found = (read_summary(job_dir) or {}).get("after_training")
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def collect(paths: list[str]) -> list[JobStatus]:
    """Status of every job under ``paths``, with one scheduler query for all of them."""
    records = []
    for job_dir in find_job_dirs(paths):
        with contextlib.suppress(OSError, ValueError):
            records.append((job_dir, read_record(job_dir)))
    infos = scheduler_states([current_job_id(r) for _, r in records])
    rows = []
    for job_dir, record in records:
        info = infos.get(current_job_id(record))
        preflight = preflight_of(job_dir, record)  # read once per job
        row = job_status(job_dir, record, info, preflight)
        settled = settled_status(record, info, row)
        if settled:  # job.json tells the truth from now on
            with contextlib.suppress(OSError, ValueError):
                update_record(job_dir, status=settled, failure=row.failure)
        fold_preflight(job_dir, record, preflight)
        rows.append(row)
    return rows


def fold_preflight(job_dir: Path, record: dict, preflight: dict | None) -> None:
    """Copy a preflight verdict that only preflight.json holds into job.json."""
    if preflight is None or record.get("preflight", {}).get("job_id") == preflight["job_id"]:
        return
    summary = {k: v for k, v in preflight.items() if k not in ("ranks", "expected")}
    with contextlib.suppress(OSError, ValueError):
        update_record(job_dir, preflight=summary, slow_nodes=slow_nodes_of(preflight))


# --- status output -------------------------------------------------------------------------

# Narrow enough for a 120-column terminal with the launcher's job dirs; the name, machine,
# model, nodes, step time, attempt and action are in --json (the name and machine are in
# the dir; the action is on the line under the table that says why the job ended).
COLUMNS = (
    ("JOB ID", lambda s: s.job_id or "-"),
    ("GRID", lambda s: short_grid(s.grid)),
    ("STATE", lambda s: s.state),
    ("STEP", lambda s: f"{s.step if s.step is not None else '-'}/{s.steps}"),
    ("LOSS", lambda s: f"{s.loss:.4g}" if s.loss is not None else "-"),
    ("TOK/S", lambda s: f"{s.tokens_per_s:.0f}" if s.tokens_per_s is not None else "-"),
    ("CLASS", lambda s: s.failure or "-"),
    ("DIR", lambda s: shown_dir(s.job_dir)),
)


def short_grid(grid: str) -> str:
    """``data=1 x=2 y=1 z=2`` as ``x2z2``: the axes above 1 (``1`` for a single rank)."""
    axes = [word.split("=") for word in grid.split()]
    text = "".join(f"{'d' if a == 'data' else a}{n}" for a, n in axes if n != "1")
    return text or ("1" if axes else "-")


def shown_dir(job_dir: str) -> str:
    """The job dir relative to the current directory when it is inside it."""
    relative = os.path.relpath(job_dir)
    return job_dir if relative.startswith("..") else relative


def format_table(rows: list[JobStatus]) -> str:
    cells = [[name for name, _ in COLUMNS]] + [[get(r) for _, get in COLUMNS] for r in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(COLUMNS) - 1)]
    return "\n".join(
        "  ".join([c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]) for row in cells
    )


def status_main(args: argparse.Namespace) -> int:
    rows = collect(args.paths or [DEFAULT_ROOT])
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    print(format_table(rows))
    for row in rows:
        for note in notes(row):
            print(f"  {row.job_id or Path(row.job_dir).name}: {note}")
    return 0


def notes(row: JobStatus) -> list[str]:
    """The lines under the table for one job: why it failed and what to do, what failed
    after a finished training, and its slow nodes."""
    lines = []
    if row.resubmitted_as:
        lines.append(f"resubmitted as {row.resubmitted_as}")
    elif row.failure not in ("", failures.COMPLETED, failures.RUNNING) and row.reason:
        lines.append(f"{row.reason} (action: {row.action})")
    elif row.failure == failures.COMPLETED:
        lines += after_training_notes(row)
    if row.slow_nodes and not any("slow nodes" in line for line in lines):
        lines.append(f"preflight named slow nodes: {', '.join(row.slow_nodes)}")
    return lines


def after_training_notes(row: JobStatus) -> list[str]:
    """A completed training's steps that did not finish, and how its job ended if not well."""
    lines = [row.reason] if row.reason.startswith("training finished, then") else []
    for name, outcome in row.after_training.items():
        if outcome != "done":
            shown = "did not finish" if outcome == "pending" else outcome
            lines.append(f"{name} after the training {shown}")
    return lines


# --- resubmission --------------------------------------------------------------------------


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    """Exclusive lock across processes on ``path`` (created if missing)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def job_lock(job_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Exclusive per-job lock across processes (flock on ``.resubmit.lock``)."""
    return _flock(Path(job_dir) / ".resubmit.lock")


def record_lock(job_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Exclusive lock on job.json's read-modify-write (launcher, job and these commands
    all write it); not ``job_lock``, which a resubmission holds while it launches."""
    return _flock(Path(job_dir) / ".record.lock")


def write_record_file(job_dir: Path, record: dict) -> None:
    """Replace job.json atomically (callers hold ``record_lock``)."""
    tmp = Path(job_dir) / f"job.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    tmp.replace(Path(job_dir) / "job.json")


def update_record(job_dir: Path, **updates) -> dict:
    """Re-read job.json, apply ``updates`` and replace the file atomically."""
    with record_lock(job_dir):
        record = read_record(Path(job_dir))
        record.update(updates)
        write_record_file(job_dir, record)
    return record


def refusal(status: JobStatus, record: dict, args: argparse.Namespace) -> str | None:
    """Why this job must not be resubmitted now, or None."""
    if status.state == DRY_RUN_STATE:
        return "a dry run: nothing to resubmit; launch it without dry_run=true"
    if record.get("resubmitted_as"):
        return f"already resubmitted as {record['resubmitted_as']}"
    if status.failure in (failures.COMPLETED, failures.RUNNING):
        return f"{status.failure}: nothing to do"
    if args.only and status.failure not in args.only:
        return f"{status.failure}: not in --only {' '.join(args.only)}"
    if status.attempt >= args.max_attempts:
        return f"attempt {status.attempt} reached --max-attempts {args.max_attempts}"
    if status.action == failures.RETRY_WITH_NEW_GRID and not reshapes(args.overrides):
        return f"{status.failure}: would fail again; resubmit with a new grid or node count"
    if status.action not in RETRIABLE + (failures.RETRY_WITH_NEW_GRID,):
        return f"{status.failure}: {status.action} ({status.reason})"
    return None


def reshapes(overrides: list[str]) -> bool:
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    return any(k == r or k.startswith(r + ".") for k in keys for r in RESHAPING_KEYS)


def original_overrides(job_dir: Path, record: dict) -> list[str]:
    """The launch's KEY=VALUE overrides; a sweep's value lists become this point's value.

    A ``--config-dir`` (site settings) becomes the ``hydra.searchpath`` override that
    composes the same tree.
    """
    from axonn_launch.cli import split_argv

    overrides, valued, _ = split_argv(list(record.get("command_line") or [])[1:])
    kept = [o for o in overrides if not o.startswith(("hydra.", "+hydra.", "hydra/"))]
    kept += [o for o in overrides if o.startswith("hydra.searchpath")]
    config_dir = valued.get("--config-dir") or valued.get("-cd")
    if config_dir:
        kept.append(f"hydra.searchpath=[file://{os.path.abspath(config_dir)}]")
    config = _load_yaml(job_dir / "config.yaml")
    return [_point_value(o, config) for o in kept]


def _point_value(override: str, config: dict | None) -> str:
    key, value = override.split("=", 1)
    if config is None or not _is_sweep(value):
        return override
    node: object = config
    for part in key.lstrip("+~").split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node = node.get("name")
    return override if node is None else f"{key}={node}"


def _is_sweep(value: str) -> bool:
    return (
        "," in value
        and not value.startswith(("[", "{", "'", '"'))
        or value.startswith(("range(", "choice(", "glob(", "interval(", "tag("))
    )


def _load_yaml(path: Path) -> dict | None:
    try:
        import yaml

        return yaml.safe_load(path.read_text())
    except Exception:
        return None


def new_overrides(old: list[str], given: list[str], exclude: tuple[str, ...]) -> list[str]:
    """Old overrides, replaced key by key by the given ones, plus exclusions and no wait."""
    given_keys = {_key(o) for o in given}
    merged = [o for o in old if _key(o) not in given_keys | {"wait", "dry_run", _key(EXCLUDE_KEY)}]
    previous = [o.split("=", 1)[1].strip("'\"") for o in old if _key(o) == _key(EXCLUDE_KEY)]
    nodes = sorted({n for p in previous for n in p.split(",") if n} | set(exclude))
    merged += given
    if nodes and _key(EXCLUDE_KEY) not in given_keys:
        merged.append(f"{EXCLUDE_KEY}={','.join(nodes)}")
    return [*merged, "wait=false"]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def for_hydra(override: str) -> str:
    """The exclude override with its node list quoted: ``n1,n2`` unquoted is a sweep to
    Hydra. Node names are checked (``NODE_NAME``), so the quotes hold them whole."""
    key, _, value = override.partition("=")
    if _key(override) != _key(EXCLUDE_KEY) or "," not in value or value[:1] in "'\"":
        return override
    return f"{key}='{value}'"


def attempt_dir(job_dir: Path, attempt: int) -> Path:
    base = re.sub(r"_attempt\d+$", "", job_dir.name)
    return job_dir.with_name(f"{base}_attempt{attempt}")


def seed_from_checkpoint(old: Path, new: Path) -> str:
    """Give the new attempt the old one's latest checkpoint (hard links) and metrics."""
    new.mkdir(parents=True, exist_ok=False)
    pointer = old / "checkpoints" / "latest"
    copied = ""
    if pointer.exists():
        name = pointer.read_text().strip()
        source = old / "checkpoints" / name
        if (source / "meta.json").exists():
            shutil.copytree(source, new / "checkpoints" / name, copy_function=_link_or_copy)
            (new / "checkpoints" / "latest").write_text(name)
            copied = name
    if (old / "metrics.jsonl").exists():
        shutil.copyfile(old / "metrics.jsonl", new / "metrics.jsonl")
    return copied


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def resume_point(job_dir: Path) -> str:
    """The step a new attempt starts from, as the resubmit line says it: the latest complete
    checkpoint (what ``seed_from_checkpoint`` gives the new attempt), else step 0."""
    pointer = job_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return "restarts from step 0: no checkpoint was saved"
    name = pointer.read_text().strip()
    try:
        meta = json.loads((job_dir / "checkpoints" / name / "meta.json").read_text())
        return f"resumes from step {int(meta['step'])} (checkpoints/{name})"
    except (OSError, ValueError, KeyError, TypeError):
        return f"restarts from step 0: checkpoints/{name}, the latest, is incomplete"


def partition_nodes(partition: str) -> tuple[str, list[str]] | None:
    """(partition name, its nodes) from one ``sinfo`` call: ``partition`` (a comma list is
    their union) or, when empty, the default one (sinfo marks it ``*``); None when sinfo is
    missing, fails or does not list it."""
    text = _run(["sinfo", "-h", "-o", "%P|%N"])
    wanted = {p for p in partition.split(",") if p}
    names, nodes = [], []
    for line in (text or "").splitlines():
        name, sep, hostlist = line.strip().partition("|")
        if sep and (name.rstrip("*") in wanted if wanted else name.endswith("*")):
            names.append(name.rstrip("*"))
            try:
                nodes += slurmtext.expand_nodelist(hostlist)
            except ValueError:
                return None
    return (",".join(dict.fromkeys(names)), list(dict.fromkeys(nodes))) if names else None


def excluded_nodes(overrides: list[str]) -> list[str]:
    """The nodes the ``--exclude`` override of a new attempt names."""
    values = [o.split("=", 1)[1].strip("'\"") for o in overrides if _key(o) == _key(EXCLUDE_KEY)]
    return [n for v in values for n in v.split(",") if n]


def nodes_needed(record: dict, given: list[str]) -> int | None:
    """The new attempt's node count: ``nodes=`` as given, else the old job's unless the
    given overrides change the grid (then only composing it tells)."""
    for override in reversed(given):
        if _key(override) == "nodes" and override.split("=", 1)[1].isdigit():
            return int(override.split("=", 1)[1])
    return None if reshapes(given) else int(record.get("nodes") or 0) or None


def schedulable_warning(
    job_dir: Path, record: dict, given: list[str], overrides: list[str]
) -> str | None:
    """Why the new attempt may never start: its exclusions leave its partition fewer nodes
    than it needs; or that this cannot be known here. None when there is nothing to say."""
    excluded = excluded_nodes(overrides)
    if record.get("scheduler", "slurm") != "slurm" or not excluded:
        return None
    partition = _given_value(given, "machine.slurm.partition")
    if partition is None:
        config = _load_yaml(job_dir / "config.yaml") or {}
        partition = str(((config.get("machine") or {}).get("slurm") or {}).get("partition") or "")
    found, needed = partition_nodes(partition), nodes_needed(record, given)
    named = f"partition {partition}" if partition else "the default partition"
    unsure = f"excluding {','.join(excluded)}: cannot tell whether enough nodes are left"
    if found is None:
        count = f"{needed} nodes" if needed else "the job's nodes"
        return f"{unsure}: sinfo does not list {named} here; check that it has {count} without them"
    if needed is None:
        return f"{unsure}: the new grid's node count is known only at submission (give nodes=N)"
    name, nodes = found
    left = [n for n in nodes if n not in excluded]
    if len(left) >= needed:
        return None
    smaller = f"resubmit with nodes={len(left)} and a grid that fits it, or " if left else ""
    return (
        f"excluding {','.join(excluded)} leaves {len(left)} of the {len(nodes)} nodes of"
        f" partition {name}, and the job needs {needed}: it can never start; {smaller}wait"
        f" until {','.join(excluded)} {'is' if len(excluded) == 1 else 'are'} back in service"
    )


def _given_value(given: list[str], key: str) -> str | None:
    values = [o.split("=", 1)[1] for o in given if _key(o) == key]
    return values[-1] if values else None


def resubmit_one(status: JobStatus, args: argparse.Namespace, out) -> str:
    """Resubmit one job under its lock; returns the outcome: one line, then the step the new
    attempt starts from. An exclusion its partition cannot satisfy warns on stderr."""
    job_dir = Path(status.job_dir)
    with job_lock(job_dir):
        record = read_record(job_dir)
        why_not = refusal(status, record, args)
        if why_not:
            return f"skip  {status.job_id or '-'} {job_dir}: {why_not}"
        attempt = int(record.get("attempt", 1)) + 1
        target = attempt_dir(job_dir, attempt)
        exclude = tuple(dict.fromkeys(status.bad_nodes + status.slow_nodes))
        overrides = [
            for_hydra(o)
            for o in new_overrides(original_overrides(job_dir, record), args.overrides, exclude)
        ]
        warning = schedulable_warning(job_dir, record, args.overrides, overrides)
        if warning:
            print(f"warning: {status.job_id} {job_dir}: {warning}", file=sys.stderr, flush=True)
        resumes = f"\n  {resume_point(job_dir)}"
        if args.dry_run:
            head = f"would resubmit {status.job_id} ({status.failure}) as {target}: "
            return head + " ".join(overrides) + resumes
        update_record(job_dir, resubmitted_as=str(target))  # the mark comes before the job
        try:
            new_id = submit_attempt(job_dir, target, record, status, overrides, attempt, out)
        except BaseException:
            update_record(job_dir, resubmitted_as="")
            shutil.rmtree(target, ignore_errors=True)
            raise
        update_record(
            job_dir, resubmitted_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), resubmitted_job=new_id
        )
        return f"resubmitted {status.job_id} ({status.failure}) as job {new_id} in {target}" + (
            resumes
        )


def submit_attempt(
    job_dir: Path,
    target: Path,
    record: dict,
    status: JobStatus,
    overrides: list[str],
    attempt: int,
    out,
) -> str:
    from omegaconf import OmegaConf

    from axonn_launch.config.compose import compose, to_launch_config
    from axonn_launch.config.validate import resolve
    from axonn_launch.submit.pipeline import launch

    composed = compose(overrides)
    cfg = to_launch_config(composed)
    resolve(cfg)  # a bad override fails here, before anything is written
    resumed_from = seed_from_checkpoint(job_dir, target)
    argv0 = (record.get("command_line") or ["axonn_launch"])[0]
    outcome = launch(
        cfg,
        job_dir=target,
        config=OmegaConf.to_container(composed, resolve=True),
        command_line=[argv0, *overrides],
        out=out,
    )
    lineage = [
        *record.get("lineage", []),
        {
            "job_dir": str(job_dir),
            "job_ids": record.get("job_ids", []),
            "attempt": int(record.get("attempt", 1)),
            "failure": status.failure,
            "reason": status.reason,
            "step": status.step,
        },
    ]
    update_record(
        target,
        attempt=attempt,
        parent=str(job_dir),
        lineage=lineage,
        resumed_from=resumed_from,
        excluded_nodes=list(dict.fromkeys(status.bad_nodes + status.slow_nodes)),
    )
    return outcome.job_id


def resubmit_main(args: argparse.Namespace) -> int:
    bad = [c for c in args.only or [] if c not in failures.CLASSES]
    if bad:
        print(
            f"error: --only {' '.join(bad)}: valid classes: {', '.join(failures.CLASSES)}",
            file=sys.stderr,
        )
        return 2
    failed = 0
    for status in collect(args.paths or [DEFAULT_ROOT]):
        try:
            print(resubmit_one(status, args, sys.stdout), flush=True)
        except Exception as exc:  # bad override, sbatch refusal: report, go on with the rest
            failed += 1
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            print(f"error {status.job_id} {status.job_dir}: {reason}", flush=True)
    return 1 if failed else 0


# --- command line --------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """One line instead of argparse's usage block; exit code 2."""
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


STATUS_EXAMPLES = (
    "python -m axonn_launch.jobs status                  # every job under jobs/",
    "python -m axonn_launch.jobs status --json jobs/sweeps/2026-11-29_10-00-00",
)
RESUBMIT_EXAMPLES = (
    "python -m axonn_launch.jobs resubmit jobs/ --dry-run  # what would be resubmitted, and why",
    "python -m axonn_launch.jobs resubmit jobs/gpt_80b-frontier/<time> nodes=64 grid=auto",
)


def _examples(lines: tuple[str, ...], note: str = "") -> str:
    return (note + "\n\n" if note else "") + "examples:\n" + "\n".join(f"  {x}" for x in lines)


def parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    top = _Parser(
        prog="python -m axonn_launch.jobs",
        description=f"What happened to my jobs, and bring back the failed ones; {JOB_DIR_HINT}.",
        epilog=_examples(STATUS_EXAMPLES + RESUBMIT_EXAMPLES),
        formatter_class=raw,
    )
    commands = top.add_subparsers(dest="command", required=True, metavar="{status,resubmit}")
    status = commands.add_parser(
        "status", help="one row per job", epilog=_examples(STATUS_EXAMPLES), formatter_class=raw
    )
    status.add_argument(
        "paths", nargs="*", help=f"job dirs or folders of them (default {DEFAULT_ROOT}/)"
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    again = commands.add_parser(
        "resubmit",
        help="resubmit the failed jobs whose failure class allows it",
        usage="python -m axonn_launch.jobs resubmit [options] [PATH ...] [KEY=VALUE ...]",
        epilog=_examples(
            RESUBMIT_EXAMPLES,
            "KEY=VALUE words are launcher overrides for the new attempts, validated like a launch.",
        ),
        formatter_class=raw,
    )
    again.add_argument(
        "paths", nargs="*", help=f"job dirs or folders of them (default {DEFAULT_ROOT}/)"
    )
    again.add_argument("--dry-run", action="store_true", help="say what would be submitted")
    again.add_argument(
        "--only",
        nargs="+",
        metavar="CLASS",
        help=f"only these classes: {', '.join(failures.CLASSES)}",
    )
    again.add_argument(
        "--max-attempts", type=int, default=5, metavar="N", help="attempts per job, all told"
    )
    for sub in (top, status, again):
        sub.add_argument("--debug", action="store_true", help="show tracebacks")
    return top


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """KEY=VALUE words are overrides; everything else goes to argparse."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    return [a for a in argv if a not in overrides], overrides


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, overrides = split_overrides(argv)
    args = parser().parse_args(rest)
    args.overrides = overrides
    if args.command == "status" and overrides:
        print(f"error: status takes no overrides: {' '.join(overrides)}", file=sys.stderr)
        return 2
    run = status_main if args.command == "status" else resubmit_main
    return run_tool(lambda _: run(args), argv, (NotAJobPath,))


if __name__ == "__main__":
    sys.exit(main())
