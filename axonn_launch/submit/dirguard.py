"""A job dir holds one run, so that what its records say is that run's: status, recovery,
resubmission and ``jobs stop`` all act on them. Checked before Hydra makes the dir or
writes into it (``GuardJobDir``, a Hydra callback after ``cli.ValidateRun``), so that a
refused launch writes nothing.

Which dirs are refused, and ``resume=true``: ``docs/launch.md`` ("submit/dirguard.py").
Login-node code: never imports torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from axonn_launch.common.formats import RESUMABLE_FORMATS
from axonn_launch.common.jobdir import (
    STEP_META,
    JobPaths,
    attempt_number,
    job_lock,
    last_job_id,
    latest_step_name,
    read_record_or_empty,
    read_step_meta,
    read_summary,
    update_record,
)
from axonn_launch.common.models import ModelSpec
from axonn_launch.config.compose import ConfigError, LaunchConfig, to_launch_config
from axonn_launch.records.jobdirs import is_dry_run
from axonn_launch.records.status import collect
from axonn_launch.scheduler import processes
from axonn_launch.scheduler.slurm_queries import squeue_states
from axonn_launch.submit import attempts, dirlock
from axonn_launch.submit.duplicates import live_state

EXIT_BAD_INPUT = 2
# what train/checkpoint/manager.py writes (FORMAT) and still resumes (LEGACY_FORMAT); the login
# node cannot import it (torch): tests/submit/test_jobdir_lock.py holds the two equal
# what a checkpoint of the same model may differ in: its preset's name, where it came from
MODEL_KEYS_IGNORED = ("name", "init_from")

CLAIMS: dict[str, dirlock.Claim] = {}  # job dir -> the lock the callback took for launch()
CONTINUING: dict[str, Path] = {}  # a resume=true attempt's dir -> the run dir it continues


class JobDirRefused(ConfigError):
    """This launch must not write into its job dir (one line; exit code 2)."""


# --- what a dir holds ----------------------------------------------------------------------


def unwritable_reason(job_dir: Path) -> str | None:
    """Why nothing can be written at ``job_dir`` (its nearest existing folder tells), or
    None. Asked of the kernel (``access``): a read-only mount says so to root too."""
    existing = job_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if os.access(existing, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return (
        f"{existing} is on a read-only file system"
        if read_only
        else f"{existing}: permission denied"
    )


def live_job(job_dir: Path) -> str | None:
    """Who lives in ``job_dir`` now, or None: the holder of its lock; else job.json's job,
    when its local supervisor runs or squeue lists it (a Slurm job holds no lock)."""
    holder = dirlock.held_by(job_dir)
    if holder:
        return holder
    job_id = last_job_id(read_record_or_empty(job_dir))
    if job_id.startswith("local-"):  # between the launcher's letting go and its supervisor's hold
        return dirlock.local_holder(job_id) if processes.live_supervisors([job_dir]) else None
    ids = [i for i in dict.fromkeys([job_id, dirlock.recorded_job_id(job_dir)]) if i]
    slurm_ids = [i for i in ids if not i.startswith("local-")]
    queued = squeue_states(slurm_ids) if slurm_ids else {}
    live = [
        f"Slurm job {i} ({queued[i].state})"
        for i in slurm_ids
        if i in queued and live_state(queued[i].state)
    ]
    return live[0] if live else None


def held_run(job_dir: Path) -> str | None:
    """What run ``job_dir`` holds (a launched job, a checkpoint, a finished run's summary),
    in words; None when it holds none (empty, new, or a dry run's only)."""
    paths = JobPaths(job_dir)
    record = read_record_or_empty(job_dir)
    found = []
    if paths.record.exists() and not record:
        found.append(f"an unreadable {paths.record.name}")
    elif last_job_id(record) and not is_dry_run(record):
        found.append(f"job {last_job_id(record)}, {record.get('status') or 'launched'}")
    step = latest_step_name(job_dir)
    if step:
        found.append(f"checkpoint {step}")
    if paths.summary.exists():
        found.append(f"a finished run's {paths.summary.name}")
    return "; ".join(found) or None


# --- the checks ----------------------------------------------------------------------------


def check(job_dir: Path, cfg: LaunchConfig) -> Path:
    """The dir this launch writes into: ``job_dir``, or with ``resume=true`` the new
    attempt that continues its run. Raises ``JobDirRefused`` (one line) when it must not."""
    why = unwritable_reason(job_dir)
    if why:
        raise JobDirRefused(
            f"cannot write the job dir {job_dir}: {why}; choose another hydra.run.dir"
        )
    holder = live_job(job_dir)
    if holder:
        raise JobDirRefused(in_use_line(job_dir, holder))
    held = held_run(job_dir)
    if held and not cfg.resume:
        raise JobDirRefused(
            f"job dir {job_dir} holds a run already ({held}): a job dir is never reused;"
            " launch into another hydra.run.dir, or continue this run from its checkpoint as a"
            f" new attempt: resume=true (or python -m axonn_launch.jobs resubmit {job_dir})"
        )
    if not cfg.resume:
        return job_dir
    if not held:
        raise JobDirRefused(
            f"resume=true: {job_dir} holds no run to continue (no launched job.json, checkpoint"
            " or summary.json); to continue an earlier run, name its dir: hydra.run.dir=<old"
            " dir> resume=true, or python -m axonn_launch.jobs resubmit <old dir>; else launch"
            " without resume=true"
        )
    return continuation_dir(job_dir, cfg)


def in_use_line(job_dir: Path, holder: str) -> str:
    return (
        f"job dir {job_dir} is in use by {holder}: a second launch into it is refused, nothing"
        f" written; follow it with python -m axonn_launch.jobs status {job_dir}, or launch into"
        " another hydra.run.dir"
    )


def continuation_dir(job_dir: Path, cfg: LaunchConfig) -> Path:
    """The new attempt of ``job_dir``'s run that ``resume=true`` launches, once the run may
    be continued by this launch (its checkpoint's model and format)."""
    done = str(read_record_or_empty(job_dir).get("resubmitted_as") or "")
    if done and JobPaths(done).record.exists():
        raise JobDirRefused(
            f"resume=true: {job_dir} was continued already, as {done}; to go on, resume that"
            f" one: hydra.run.dir={done} resume=true"
        )
    problem = checkpoint_problem(job_dir, cfg)
    if problem:
        raise JobDirRefused(f"resume=true: {problem}")
    target = attempts.attempt_dir(job_dir, attempt_number(job_dir) + 1)
    taken = live_job(target) or held_run(target)
    if taken:
        raise JobDirRefused(
            f"resume=true: {target}, the new attempt's dir, holds a run already ({taken})"
        )
    return target


def checkpoint_problem(job_dir: Path, cfg: LaunchConfig) -> str | None:
    """Why this launch cannot continue from ``job_dir``'s latest checkpoint (another model,
    a format this launcher does not resume, nothing left to train), read from its meta
    json on this node; None when it can, or when there is no checkpoint (it restarts from
    step 0, as a resubmission does)."""
    name = latest_step_name(job_dir)
    if not name:
        if read_summary(job_dir) is not None:
            return f"{job_dir} finished without a checkpoint: nothing to continue from"
        return None
    step_dir = JobPaths(job_dir).step(name)
    try:
        meta = read_step_meta(step_dir)
    except (OSError, ValueError) as exc:
        return f"{step_dir / STEP_META} is unreadable ({type(exc).__name__}: {exc})"
    fmt = meta.get("format")
    if fmt not in RESUMABLE_FORMATS:
        return (
            f"{step_dir} has format {fmt!r}; this launcher resumes {', '.join(RESUMABLE_FORMATS)}"
        )
    differs = model_differences(meta.get("model"), cfg.model)
    if differs:
        saved = (
            (meta.get("model") or {}).get("name", "?")
            if isinstance(meta.get("model"), dict)
            else "?"
        )
        return (
            f"{step_dir} holds model {saved} and this launch's is {cfg.model.name}"
            f" ({'; '.join(differs[:4])}): a run resumes its own model only; launch"
            f" {cfg.model.name} into another hydra.run.dir"
        )
    step = int(meta.get("step") or 0)
    if cfg.train.steps <= step:
        return f"train.steps={cfg.train.steps}: {step_dir} is at step {step}; give more steps"
    return None


def model_differences(saved: Any, model: ModelSpec) -> list[str]:
    """``key saved vs ours`` for each field of the model that differs from the checkpoint's
    (fields the checkpoint does not record are not compared)."""
    if not isinstance(saved, dict):
        return [f"the checkpoint's {STEP_META} names no model"]
    ours = asdict(model)
    return [
        f"{key} {saved[key]!r} vs {value!r}"
        for key, value in ours.items()
        if key not in MODEL_KEYS_IGNORED and key in saved and saved[key] != value
    ]


# --- the lock for the launch, and the continuation it starts ---------------------------------


def take(job_dir: Path) -> dirlock.Claim:
    """The dir's lock for this launch; ``JobDirRefused`` when another process holds it or
    the dir cannot be written."""
    try:
        taken = dirlock.claim(job_dir)
    except OSError as exc:
        said = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
        raise JobDirRefused(
            f"cannot write the job dir {job_dir}: {said}; choose another hydra.run.dir"
        ) from None
    if taken is None:
        raise JobDirRefused(in_use_line(job_dir, dirlock.held_by(job_dir) or "another launch"))
    return taken


@contextlib.contextmanager
def claimed(job_dir: Path) -> Iterator[dirlock.Claim]:
    """The launch's hold on ``job_dir`` (the callback's, else taken now), let go at the end:
    a local job's supervisor has taken it over by then, a Slurm job is named in it."""
    taken = CLAIMS.pop(str(job_dir.resolve()), None) or take(job_dir)
    try:
        yield taken
    finally:
        taken.release()


def continuation(job_dir: Path, dry_run: bool) -> dict:
    """For the attempt ``resume=true`` made: job.json's ``attempt``, ``parent``, ``lineage``
    and ``resumed_from``; unless a dry run, the run dir is marked (``resubmitted_as``) and
    the attempt gets its checkpoint and metrics, as ``jobs resubmit`` gives them. {} for
    any other launch."""
    parent = CONTINUING.pop(str(job_dir.resolve()), None)
    if parent is None:
        return {}
    with job_lock(parent):
        record = read_record_or_empty(parent)
        want = parent.resolve()
        status = next(
            (r for r in collect([str(parent)]) if Path(r.job_dir).resolve() == want), None
        )
        resumed_from = ""
        if not dry_run:
            update_record(parent, resubmitted_as=str(job_dir))
            resumed_from = attempts.seed_from_checkpoint(parent, job_dir, exist_ok=True)
    return {
        "attempt": attempt_number(parent) + 1,
        "parent": str(parent),
        "lineage": attempts.lineage_of(parent, record, status),
        "resumed_from": resumed_from,
    }


def undo_continuation(job_dir: Path, continued: dict) -> None:
    """A continuation whose job never started (the launch failed, sbatch refused it): its
    run dir is no longer marked, and what it was given goes, so that ``resume=true`` may
    make it again."""
    if last_job_id(read_record_or_empty(job_dir)) or not continued.get("parent"):
        return
    with contextlib.suppress(OSError, ValueError):
        update_record(Path(continued["parent"]), resubmitted_as="")
    paths = JobPaths(job_dir)
    shutil.rmtree(paths.checkpoints, ignore_errors=True)
    for given in (paths.metrics, paths.skipped_steps):
        given.unlink(missing_ok=True)


class GuardJobDir(Callback):
    """conf/config.yaml's ``hydra.callbacks``: a run's job dir is checked (``check``) and
    locked before Hydra makes it; with ``resume=true`` Hydra's run dir becomes the new
    attempt's. A refusal is one line and exit code 2."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        tree = OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])
        try:
            # resolved once: Hydra's ``now`` is cached on this config, so Hydra makes this dir
            job_dir = Path(os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir"))))
            target = check(job_dir, to_launch_config(tree))
            CLAIMS[str(target.resolve())] = take(target)  # it makes the dir
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT) from None
        if target != job_dir:
            CONTINUING[str(target.resolve())] = job_dir
            with read_write(config), open_dict(config):
                config.hydra.run.dir = str(target)
