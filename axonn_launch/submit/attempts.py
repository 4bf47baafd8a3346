"""A run's attempts side by side: ``<job_dir>_attempt<N>``, each started from a hard-linked
copy of its parent's latest checkpoint and its metrics up to it, its job.json naming the
attempts before it (``lineage``). Made by ``jobs resubmit`` (batch/resubmit.py) and by a
launch with ``resume=true`` (submit/dirguard.py).

Login-node code: never imports torch.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from axonn_launch.common.jobdir import (
    STEP_META,
    JobPaths,
    checkpointed_step,
    latest_step_name,
    metrics_through,
)

if TYPE_CHECKING:
    from axonn_launch.records.status import JobStatus


def attempt_dir(job_dir: Path, attempt: int) -> Path:
    base = re.sub(r"_attempt\d+$", "", job_dir.name)
    return job_dir.with_name(f"{base}_attempt{attempt}")


def seed_from_checkpoint(old: Path, new: Path, exist_ok: bool = False) -> str:
    """Give the new attempt the old one's latest checkpoint (hard links) and its metrics up
    to that checkpoint's step. ``exist_ok``: its dir was made already (a ``resume=true``
    launch's, by Hydra: submit/dirguard.py)."""
    new.mkdir(parents=True, exist_ok=exist_ok)
    before, after = JobPaths(old), JobPaths(new)
    name = latest_step_name(old)
    copied = ""
    if name and (before.step(name) / STEP_META).exists():
        shutil.copytree(before.step(name), after.step(name), copy_function=_link_or_copy)
        after.latest.write_text(name)
        copied = name
    copy_metrics_through(before.metrics, after.metrics, checkpointed_step(new))
    if before.skipped_steps.exists():  # a rollback's skipped batches hold in every attempt
        shutil.copy2(before.skipped_steps, after.skipped_steps)
    return copied


def copy_metrics_through(source: Path, target: Path, step: int) -> None:
    """The rows of ``source`` up to ``step`` (the new attempt's first step is the next):
    until the attempt logs a step, the step its metrics show is the one it resumes from,
    never one of the old run's after its checkpoint. Lines that are not whole rows go."""
    if source.exists():
        kept, _ = metrics_through(source, step)
        target.write_text("".join(line + "\n" for line in kept))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def lineage_of(job_dir: Path, record: dict, status: JobStatus | None) -> list[dict]:
    """A new attempt's ``lineage``: its parent's, then the parent itself (its jobs, and how
    it ended: ``status``; None when it has no status row)."""
    return [
        *record.get("lineage", []),
        {
            "job_dir": str(job_dir),
            "job_ids": record.get("job_ids", []),
            "attempt": int(record.get("attempt", 1)),
            "failure": status.failure if status else "",
            "reason": status.reason if status else "",
            "step": status.step if status else None,
        },
    ]
