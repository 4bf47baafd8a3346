"""Bring a failed job back: a new attempt in a sibling directory ``<job_dir>_attempt<N>``
that starts from a hard-linked copy of the latest checkpoint, with the job's original
overrides plus the given ones (validated like any launch), and ``--exclude`` for the nodes a
node or collective failure points at and for the slow nodes its preflight named.

Idempotent (a per-job lock and a ``resubmitted_as`` mark); a completed job given a larger
``train.steps`` is extended instead. Details: ``docs/recovery.md`` ("batch/resubmit.py").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

from axonn_launch.common.jobdir import (
    CHECKPOINTS,
    RECORD_TIME,
    JobPaths,
    checkpointed_step,
    job_lock,
    latest_step_name,
    read_record,
    read_record_or_empty,
    read_step_meta,
    run_root,
    update_record,
)
from axonn_launch.config.compose import SITE_ENV, split_argv, using_site
from axonn_launch.records import failures
from axonn_launch.records.jobdirs import DRY_RUN_STATE, saved_config
from axonn_launch.records.status import JobStatus
from axonn_launch.scheduler.base import recorded
from axonn_launch.submit import chain
from axonn_launch.submit.attempts import attempt_dir, lineage_of, seed_from_checkpoint

RETRIABLE = (failures.RESUME, failures.RESUME_EXCLUDING)
# overrides that change what a job needs per GPU: with one, an out-of-memory job may retry
RESHAPING_KEYS = ("grid", "nodes", "train.micro_batch", "train.activation_checkpointing")
EXCLUDE_KEY = "+machine.slurm.extra_sbatch.exclude"


MAX_ATTEMPTS = 5  # jobs resubmit --max-attempts: attempts per job, all told


def interrupted_mark(target: str) -> bool:
    """A ``resubmitted_as`` whose attempt never got its job.json: the resubmission that
    wrote it died (its process was killed, its node went down) before submitting. Asked
    under the job's lock, so no resubmission of it is under way now."""
    return not JobPaths(target).record.exists()


def refusal(status: JobStatus, record: dict, args: argparse.Namespace) -> str | None:
    """Why this job must not be resubmitted now, or None."""
    if status.state == DRY_RUN_STATE:
        return "a dry run: nothing to resubmit; launch it without dry_run=true"
    if status.unreachable:  # its end is not known: nothing is done from an absence
        return f"{status.reason} ({status.unreachable})"
    if record.get("resubmitted_as") and not interrupted_mark(record["resubmitted_as"]):
        return f"already resubmitted as {record['resubmitted_as']}"
    if status.failure == failures.RUNNING:
        return f"{status.failure}: nothing to do"
    if args.only and status.failure not in args.only:
        return f"{status.failure}: not in --only {' '.join(args.only)}"
    if status.failure == failures.COMPLETED:  # an extension: not counted in --max-attempts
        return extension_refusal(
            Path(status.job_dir), args.overrides, extension_asked(status, args)
        )
    if status.attempt >= args.max_attempts:
        return f"attempt {status.attempt} reached --max-attempts {args.max_attempts}"
    if getattr(args, "decided", False):  # the recovery policy chose to resume this class
        return stopped_meanwhile(Path(status.job_dir), record)  # (batch/recovery.py)
    if status.action == failures.RETRY_WITH_NEW_GRID and not reshapes(args.overrides):
        return f"{status.failure}: would fail again; resubmit with a new grid or node count"
    if status.action not in RETRIABLE + (failures.RETRY_WITH_NEW_GRID,):
        return f"{status.failure}: {status.action} ({status.reason})"
    return None


def stopped_meanwhile(job_dir: Path, record: dict) -> str | None:
    """Why the chain's own resubmission must not go on: the run was stopped since its
    recovery step began (``jobs stop`` holds this job's lock while it stops the run)."""
    found = chain.chain_of(run_root(job_dir, record))
    if found.get("state") != chain.STOPPED:
        return None
    return f"the run was stopped ({(found.get('stop') or {}).get('reason') or 'jobs stop'})"


def reopen_stopped_run(job_dir: Path, record: dict, target: Path) -> dict | None:
    """A person's resubmission of a stopped run starts the run again: chain.state running,
    its newest attempt ``target``. The chain as it was (to put back if the submission
    fails), or None when the run was not stopped."""
    root = run_root(job_dir, record)
    before = chain.chain_of(root)
    if before.get("state") != chain.STOPPED:
        return None
    settings = chain.settings_of(read_record_or_empty(root))
    chain.set_chain(root, settings, state=chain.RUNNING, current=str(target), stop={},
                    stopped_by_user=False)  # fmt: skip
    return before


def restore_chain(job_dir: Path, record: dict, before: dict) -> None:
    """Put back the chain ``reopen_stopped_run`` changed (the submission failed)."""
    root = run_root(job_dir, record)
    kept = {k: before[k] for k in ("state", "current", "stop", "stopped_by_user") if k in before}
    chain.set_chain(root, chain.settings_of(read_record_or_empty(root)), **kept)


def extension_asked(status: JobStatus, args: argparse.Namespace) -> bool:
    """Whether the user asked for this completed job: its dir is a PATH of the command, or
    ``--only completed`` (a ``train.steps`` meant for the failed jobs of a tree extends
    none of its completed ones)."""
    named = {str(Path(p).resolve()) for p in getattr(args, "paths", None) or []}
    return str(Path(status.job_dir).resolve()) in named or failures.COMPLETED in (args.only or [])


def extension_refusal(job_dir: Path, given: list[str], asked: bool) -> str | None:
    """Why a completed job cannot be extended with the ``given`` overrides, or None: an
    extension needs ``train.steps`` above the step of its last checkpoint, and a job the
    user ``asked`` for (``extension_asked``); to such a job the line says how."""
    start = checkpointed_step(job_dir)
    steps = _given_value(given, "train.steps")
    if not asked:
        how = " (name its dir, or --only completed, to extend it)" if steps else ""
        return f"completed: nothing to do{how}"
    if steps is None:
        return f"completed: nothing to do without train.steps=N (N > {start} extends it)"
    if not steps.isdigit():
        return f"train.steps={steps}: expected a whole number of steps above {start}"
    if not latest_step_name(job_dir):
        return "completed without a checkpoint: nothing to extend from; launch it again"
    if int(steps) <= start:
        return f"train.steps={steps}: completed at step {start}; give N > {start} to extend it"
    return None


def extension_overrides(job_dir: Path, given: list[str]) -> list[str]:
    """An extension's overrides: the given ones, and the step its schedule restarts from
    (the checkpoint it resumes from) unless given; an extension of an extension moves it."""
    if _given_value(given, "train.schedule_start") is not None:
        return list(given)
    return [*given, f"train.schedule_start={checkpointed_step(job_dir)}"]


def reshapes(overrides: list[str]) -> bool:
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    return any(k == r or k.startswith(r + ".") for k in keys for r in RESHAPING_KEYS)


def original_overrides(job_dir: Path, record: dict) -> list[str]:
    """The launch's KEY=VALUE overrides; a sweep's value lists become this point's value.

    A ``--config-dir`` (site settings) becomes the ``hydra.searchpath`` override that
    composes the same tree.
    """

    overrides, valued, _ = split_argv(list(record.get("command_line") or [])[1:])
    kept = [o for o in overrides if not o.startswith(("hydra.", "+hydra.", "hydra/"))]
    kept += [o for o in overrides if o.startswith("hydra.searchpath")]
    config_dir = valued.get("--config-dir") or valued.get("-cd")
    if config_dir:
        kept.append(f"hydra.searchpath=[file://{os.path.abspath(config_dir)}]")
    config = saved_config(job_dir)
    return [_point_value(o, config) for o in kept]


def recorded_site(record: dict) -> str | None:
    """The site directory the job was launched with (job.json ``site_dir``, docs/site.md),
    so that its profile is found again; a record from before sites were recorded: the
    current ``AXONN_SITE_DIR``."""
    return record["site_dir"] if "site_dir" in record else os.environ.get(SITE_ENV)


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


def new_overrides(old: list[str], given: list[str], exclude: tuple[str, ...]) -> list[str]:
    """Old overrides, replaced key by key by the given ones (a given key replaces the keys
    under it too: ``grid=auto`` drops ``grid.x=2``), plus exclusions; ``wait=false`` unless
    ``wait=`` is given (the old launch's is never kept)."""
    given_keys = {_key(o) for o in given}
    replaced = given_keys | {"wait", "dry_run", _key(EXCLUDE_KEY)}
    merged = [o for o in old if not _under_any(_key(o), replaced)]
    previous = [o.split("=", 1)[1].strip("'\"") for o in old if _key(o) == _key(EXCLUDE_KEY)]
    nodes = sorted({n for p in previous for n in p.split(",") if n} | set(exclude))
    merged += given
    if nodes and _key(EXCLUDE_KEY) not in given_keys:
        merged.append(f"{EXCLUDE_KEY}={','.join(nodes)}")
    return merged if "wait" in given_keys else [*merged, "wait=false"]


def _under_any(key: str, keys: set[str]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def for_hydra(override: str) -> str:
    """The exclude override with its node list quoted: ``n1,n2`` unquoted is a sweep to
    Hydra. Node names are checked (``NODE_NAME``), so the quotes hold them whole."""
    key, _, value = override.partition("=")
    if _key(override) != _key(EXCLUDE_KEY) or "," not in value or value[:1] in "'\"":
        return override
    return f"{key}='{value}'"


def resume_point(job_dir: Path) -> str:
    """The step a new attempt starts from, as the resubmit line says it: the latest complete
    checkpoint (what ``seed_from_checkpoint`` gives the new attempt), else step 0."""
    name = latest_step_name(job_dir)
    if not name:
        return "restarts from step 0: no checkpoint was saved"
    try:
        meta = read_step_meta(JobPaths(job_dir).step(name))
        return f"resumes from step {int(meta['step'])} ({CHECKPOINTS}/{name})"
    except (OSError, ValueError, KeyError, TypeError):
        return f"restarts from step 0: {CHECKPOINTS}/{name}, the latest, is incomplete"


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
    if not recorded(record).queued or not excluded:
        return None
    partition = _given_value(given, "machine.slurm.partition")
    if partition is None:
        config = saved_config(job_dir) or {}
        partition = str(((config.get("machine") or {}).get("slurm") or {}).get("partition") or "")
    found, needed = recorded(record).partition_nodes(partition), nodes_needed(record, given)
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
    with job_lock(job_dir), using_site(recorded_site(read_record(job_dir))):
        record = read_record(job_dir)
        why_not = refusal(status, record, args)
        if why_not:
            return f"skip  {status.job_id or '-'} {job_dir}: {why_not}"
        attempt = int(record.get("attempt", 1)) + 1
        target = attempt_dir(job_dir, attempt)
        exclude = tuple(dict.fromkeys(status.bad_nodes + status.slow_nodes))
        extending = status.failure == failures.COMPLETED
        given = extension_overrides(job_dir, args.overrides) if extending else args.overrides
        overrides = [
            for_hydra(o) for o in new_overrides(original_overrides(job_dir, record), given, exclude)
        ]
        warning = schedulable_warning(job_dir, record, args.overrides, overrides)
        if warning:
            print(f"warning: {status.job_id} {job_dir}: {warning}", file=sys.stderr, flush=True)
        resumes = f"\n  {resume_point(job_dir)}" + (schedule_line(given) if extending else "")
        verb = "extend" if extending else "resubmit"
        if args.dry_run:
            head = f"would {verb} {status.job_id} ({status.failure}) as {target}: "
            return head + " ".join(overrides) + resumes
        update_record(job_dir, resubmitted_as=str(target))  # the mark comes before the job
        if extending:
            continue_chain(job_dir, record, target)
        stopped = reopen_stopped_run(job_dir, record, target)  # not the chain's: refused
        try:
            outcome = submit_attempt(job_dir, target, record, status, overrides, attempt, out)
        except BaseException:
            update_record(job_dir, resubmitted_as="")
            if extending:
                continue_chain(job_dir, record, job_dir, done=True)
            if stopped is not None:
                restore_chain(job_dir, record, stopped)
            shutil.rmtree(target, ignore_errors=True)
            raise
        update_record(
            job_dir,
            resubmitted_at=time.strftime(RECORD_TIME),
            resubmitted_job=outcome.job_id,
        )
        done = "extended" if extending else "resubmitted"
        return f"{done} {status.job_id} ({status.failure}) as job {outcome.job_id} in" + (
            f" {target}{resumes}{ended(outcome)}"
        )


def schedule_line(given: list[str]) -> str:
    """The extension's learning-rate rule, as the resubmit line states it."""
    start, steps = _given_value(given, "train.schedule_start"), _given_value(given, "train.steps")
    return (
        f"\n  the learning rate restarts at step {start}: warmup (train.warmup_steps) and a"
        f" cosine from train.lr down to train.min_lr at step {steps}"
    )


def continue_chain(job_dir: Path, record: dict, current: Path, done: bool = False) -> None:
    """A run that recovers itself goes on with its extension: running again, its newest
    attempt ``current`` (it was done; ``done``: the extension was not submitted)."""
    root = run_root(job_dir, record)
    root_record = read_record_or_empty(root)
    if root_record.get("chain") or "recovery" in root_record:
        state = chain.DONE if done else chain.RUNNING
        chain.set_chain(root, chain.settings_of(root_record), state=state, current=str(current))


def ended(outcome) -> str:
    """How a waited attempt ended (nothing for one that was only submitted)."""
    if outcome.status in ("submitted", "dry_run"):
        return ""
    return f"\n  the attempt ended {outcome.status} ({outcome.message})"


def submit_attempt(
    job_dir: Path,
    target: Path,
    record: dict,
    status: JobStatus,
    overrides: list[str],
    attempt: int,
    out,
):
    """Launch the new attempt in ``target``; its job.json names its attempt, parent and
    lineage from the start (a waited attempt is followed to its end). Returns the launch's
    ``Outcome``."""
    from omegaconf import OmegaConf

    from axonn_launch.config.compose import compose, to_launch_config
    from axonn_launch.submit.pipeline import check, launch

    composed = compose(overrides)
    # a new job, even from inside one (a recovery job's allocation, a batch script): never
    # a step of the allocation it is run in (submit/allocation.py)
    cfg = dataclasses.replace(to_launch_config(composed), allocation="new")
    checked = check(cfg, str(Path(target).resolve()))  # a bad override fails here: nothing written
    resumed_from = seed_from_checkpoint(job_dir, target)
    argv0 = (record.get("command_line") or ["axonn_launch"])[0]
    lineage = lineage_of(job_dir, record, status)
    return launch(
        checked,
        job_dir=target,
        config=OmegaConf.to_container(composed, resolve=True),
        command_line=[argv0, *overrides],
        out=out,
        record_extra={
            "attempt": attempt,
            "parent": str(job_dir),
            "lineage": lineage,
            "resumed_from": resumed_from,
            "excluded_nodes": list(dict.fromkeys(status.bad_nodes + status.slow_nodes)),
        },
    )
