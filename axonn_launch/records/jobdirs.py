"""Finding job dirs (every folder holding a job.json at or below a path) and reading what
one holds besides job.json's schema (``common/jobdir.py``): whether it is a dry run, its
saved config, its loss and speed, its preflight verdict, its stragglers, what ran after
the training, and the attempts it was resubmitted as.

Login-node code: never imports torch.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from axonn_launch.common.jobdir import (
    CHECKPOINTS,
    HYDRA,
    LOGS,
    PREFLIGHT,
    RECORD,
    SLURM,
    SUBMITIT,
    JobPaths,
    RecordError,
    is_job_dir,
    last_job_id,
    last_metrics,
    read_record,
    read_stragglers,
    read_summary,
)

DEFAULT_ROOT = "jobs"
SKIP_DIRS = frozenset({SLURM, CHECKPOINTS, LOGS, HYDRA, SUBMITIT})
NODE_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")  # what may go into --exclude


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
    if is_job_dir([e.name for e in entries]):
        found.append(path)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and entry.name not in SKIP_DIRS:
            _walk(Path(entry.path), found)


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


def saved_config(job_dir: Path | str) -> dict | None:
    """The resolved config the launch saved in the job dir (None when unreadable)."""
    try:
        import yaml

        found = yaml.safe_load(JobPaths(job_dir).config.read_text())
    except Exception:
        return None
    return found if isinstance(found, dict) else None


@dataclass(frozen=True)
class RunResults:
    """Loss and speed of a run: its summary once it finished, else its last step."""

    loss: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None


def run_results(job_dir: Path, metrics: dict | None = None) -> RunResults:
    """From summary.json while it is the newest evidence, else from ``metrics`` (the last
    step's row, read if not given): a requeued allocation's own steps, not the summary the
    previous allocation left when it stopped."""
    row = metrics if metrics is not None else last_metrics(Path(job_dir)) or {}
    summary = current_summary(Path(job_dir), row)
    if summary is None:
        summary = {"final_loss": row.get("loss"), **row}
    values = [summary.get(k) for k in ("final_loss", "tokens_per_s", "step_time_s")]
    return RunResults(*(_finite(v) for v in values))


def current_summary(job_dir: Path, row: dict) -> dict | None:
    """summary.json, unless metrics.jsonl's last row ``row`` is newer evidence: a step past
    the summary's, or rows written after it (a requeued or resumed allocation appends to
    metrics.jsonl, or cuts it back to its checkpoint, while the summary its predecessor
    wrote on stopping is still there). A finished run writes its summary after its last
    row, so the summary stands."""
    summary = read_summary(job_dir)
    if summary is None or not row:
        return summary
    if int(row.get("step") or 0) > int(summary.get("steps") or 0):
        return None
    paths = JobPaths(job_dir)
    try:
        newer = paths.metrics.stat().st_mtime_ns > paths.summary.stat().st_mtime_ns
    except OSError:  # one of them went away meanwhile: the summary was read, keep it
        return summary
    return None if newer else summary


def _finite(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def preflight_of(job_dir: Path, record: dict) -> dict | None:
    """The preflight verdict of the job ``record`` names now: job.json's, else the job's
    own ``preflight.json`` (written a moment before job.json could be); None for another
    job's (a reused job dir) or none at all."""
    job_id = last_job_id(record)
    found = record.get("preflight")
    if not (isinstance(found, dict) and found.get("job_id") == job_id):
        try:
            found = json.loads((Path(job_dir) / PREFLIGHT).read_text())
        except (OSError, ValueError):
            return None
    return found if isinstance(found, dict) and job_id and found.get("job_id") == job_id else None


def slow_nodes_of(preflight: dict | None) -> list[str]:
    """The preflight's slow nodes that are plain node names (they go into --exclude)."""
    nodes = (preflight or {}).get("slow_nodes") or []
    return [str(n) for n in nodes if NODE_NAME.fullmatch(str(n))] if isinstance(nodes, list) else []


def stragglers_of(job_dir: Path) -> dict:
    """``stragglers`` and ``straggler_step`` of the newest straggler report (also while
    the job runs); none without one."""
    report = read_stragglers(job_dir) or {}
    named = [s for s in report.get("stragglers") or [] if isinstance(s, dict)]
    step = report.get("step")
    return {"stragglers": named, "straggler_step": step if isinstance(step, int) else None}


def after_training_of(job_dir: Path) -> dict[str, str]:
    """summary.json's ``after_training``: step -> "done", "failed: ..." or "pending"."""
    found = (read_summary(job_dir) or {}).get("after_training")
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def read_one(job_dir: Path) -> dict | str:
    """job.json, or why it cannot be trusted (``unreadable_row``'s words)."""
    try:
        return read_record(job_dir)
    except RecordError as error:
        return str(error)
    except OSError as error:  # unreadable (permissions), or gone since the walk
        return f"{RECORD}: {error.strerror or error}"


def with_later_attempts(records: list[tuple[Path, dict | str]]) -> list[tuple[Path, dict | str]]:
    """``records`` and, after them, each attempt one was resubmitted as (``resubmitted_as``,
    followed to the newest) that is not among them yet."""
    found = list(records)
    seen = {str(job_dir.resolve()) for job_dir, _ in found}
    for _, record in found:  # grows while read: an attempt's own later attempt comes too
        later = record.get("resubmitted_as") if isinstance(record, dict) else None
        if not later or str(Path(later).resolve()) in seen:
            continue
        if not JobPaths(later).record.is_file():  # a resubmission under way, or one that died
            continue
        seen.add(str(Path(later).resolve()))
        found.append((Path(later), read_one(Path(later))))
    return found
