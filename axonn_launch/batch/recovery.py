"""The recovery step (``python -m axonn_launch.recover``, ``main`` here): classify the failed
attempt, apply the policy and the limits, shrink the grid when nodes are gone, and resubmit;
when the step itself fails, stop the run in one line. How the step is started, and the run's
record, are ``submit/chain.py``'s.

Each attempt the chain records (``chain.attempts`` in the run's job.json) keeps its class,
action, the step its metrics reached, the step it failed at (a hang's or a non-finite
step's, when one was named: ``failed_step``) and the step of its newest complete
checkpoint (``checkpointed``), which ``recovery.max_no_progress`` compares across
attempts. A rollback (a non-finite step under ``recovery.policy.non_finite=rollback``)
adds the step to the failed attempt's ``skipped_steps.json``, which the next attempt,
seeded from that attempt's newest checkpoint (older than the step: nothing is saved at
or after a non-finite step), reads to skip the step's batch; once per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from axonn_launch.batch.resubmit import (
    EXCLUDE_KEY,
    excluded_nodes,
    original_overrides,
    resubmit_one,
)
from axonn_launch.common.jobdir import (
    add_skipped_step,
    checkpointed_step,
    read_record,
    read_record_or_empty,
    read_stragglers,
    run_root,
    skipped_steps,
)
from axonn_launch.config.compose import RecoveryConfig
from axonn_launch.records import curves, failures
from axonn_launch.records.status import JobStatus, collect
from axonn_launch.scheduler.base import recorded
from axonn_launch.scheduler.slurm import SLURM
from axonn_launch.submit.chain import (
    DONE,
    RECOVERING,
    RESUME,
    RESUME_EXCLUDE,
    ROLLBACK,
    RUNNING,
    STOP,
    STOPPED,
    attempts_of,
    chain_of,
    policy_of,
    set_chain,
    settings_of,
)
from axonn_launch.submit.in_job import RECORD_KEY


def limit_reached(settings: RecoveryConfig, attempts: list[dict], started: float) -> str:
    """Which limit stops the run after these ended attempts ('' if none)."""
    attempts = distinct(attempts)
    if len(attempts) >= settings.max_attempts:
        return f"recovery.max_attempts={settings.max_attempts}: {len(attempts)} attempts made"
    last = attempts[-1]["class"]
    repeats = 0
    for attempt in reversed(attempts):
        if attempt["class"] != last:
            break
        repeats += 1
    if repeats >= settings.max_same_class:
        return f"recovery.max_same_class={settings.max_same_class}: {last} {repeats} times in a row"
    stalled = no_progress(settings.max_no_progress, attempts)
    if stalled:
        return stalled
    hours = (time.time() - started) / 3600
    if settings.budget_h and hours >= settings.budget_h:
        return f"recovery.budget_h={settings.budget_h:g}: {hours:.2f} h spent"
    return ""


FAILURE_KEY = "failure_key"  # one record per failed allocation step: "<job id>.<step>"


def failure_key(job_id: str, record: dict) -> str:
    """The key of the failure of job ``job_id``'s newest training step (its ordinal among
    the job's in-place steps, 0 for the first): the restart decision and the recovery
    step name the same failure alike (``docs/recovery.md``, "one failure, one record")."""
    steps = (record.get(RECORD_KEY) or {}).get("steps") or []
    return f"{job_id}.{sum(1 for s in steps if s.get('job_id') == job_id)}"


def distinct(attempts: list[dict]) -> list[dict]:
    """``attempts`` with one entry per failure: a later entry of a key already seen
    replaces it (entries without a key each count)."""
    kept: dict[str, dict] = {}
    for n, attempt in enumerate(attempts):
        kept[str(attempt.get(FAILURE_KEY) or f"#{n}")] = attempt
    return list(kept.values())


def with_attempt(history: list[dict], ended: dict) -> list[dict]:
    """The chain's attempts with ``ended`` recorded once: an entry the restart decision
    made for the same failure (its key) is completed with the chain's verdict, in place."""
    same = [n for n, a in enumerate(history) if a.get(FAILURE_KEY) == ended[FAILURE_KEY]]
    if not same:
        return [*history, ended]
    at = same[-1]
    merged = {**history[at], **ended, "by_chain": True}
    for field in ("step", "failed_step", "reason"):  # the decision saw the step end first
        merged[field] = history[at].get(field, ended[field]) or ended[field]
    return [*history[:at], merged, *history[at + 1 :]]


def no_progress(limit: int, attempts: list[dict]) -> str:
    """Why the run stops when each of its last ``limit`` attempts ended without a
    checkpoint newer than the attempt before it left (each resumes from that one; the run
    starts from step 0), whatever their classes; '' otherwise, or when an attempt's
    ``checkpointed`` step was not recorded."""
    saved = [0, *(a.get("checkpointed") for a in attempts)]
    window = saved[-limit - 1 :]
    if len(saved) <= limit or not all(isinstance(s, int) for s in window):
        return ""
    if any(now > before for before, now in zip(window, window[1:])):
        return ""
    return (
        f"recovery.max_no_progress={limit}: {limit} attempts in a row saved no checkpoint"
        f" newer than the one they resumed from (the newest: step {window[-1]})"
    )


def straggler_nodes(job_dir: Path) -> list[str]:
    """The nodes the attempt's newest straggler report names (``stragglers.json``)."""
    report = read_stragglers(job_dir) or {}
    nodes = [str(s.get("node", "")) for s in report.get("stragglers") or [] if isinstance(s, dict)]
    return list(dict.fromkeys(n for n in nodes if failures.NODE_NAME.fullmatch(n)))


def with_stragglers(
    settings: RecoveryConfig, status: JobStatus, action: str, job_dir: Path
) -> tuple[JobStatus, str]:
    """``recovery.exclude_stragglers``: the straggler report's nodes join the nodes the
    next attempt leaves out (a resume then leaves them out too)."""
    named = straggler_nodes(job_dir) if settings.exclude_stragglers else []
    new = [n for n in named if n not in status.bad_nodes]
    if not new or action == STOP:
        return status, action
    return replace(status, bad_nodes=[*status.bad_nodes, *new]), (
        RESUME_EXCLUDE if action == RESUME else action
    )


def rollback(job_dir: Path, status: JobStatus, history: list[dict]) -> str:
    """Make the next attempt skip the non-finite step's batch: add it to the failed
    attempt's skipped steps. Why it cannot ('' when done): no step named, a rollback past
    this step before (once per step), or no checkpoint older than the step."""
    step = status.detail.get("step")
    if not isinstance(step, int):
        return "non_finite: policy rollback, but the failure names no step"
    rolled = [a for a in history if a.get("action") == ROLLBACK and a.get("failed_step") == step]
    if rolled or step in skipped_steps(job_dir):
        return f"non_finite at step {step} again after a rollback past it (once per step)"
    saved = checkpointed_step(job_dir)
    if saved >= step:
        return f"non_finite at step {step}: the newest checkpoint (step {saved}) is not older"
    add_skipped_step(job_dir, step)
    return ""


def carry_skipped_steps(job_dir: Path, target: Path) -> None:
    """The next attempt's dir holds every step the failed one skips (a resubmission seeds
    it with them; this adds any it lacks)."""
    have = set(skipped_steps(target))
    for step in skipped_steps(job_dir):
        if step not in have:
            add_skipped_step(target, step)


usable_nodes = SLURM.nodes_up  # the partition's nodes that are up now (None: sinfo cannot tell)


def nodes_up(record: dict) -> list[str] | None:
    """The nodes of the job's partition that are up now; None when sinfo cannot tell, and
    for a local job: sinfo knows nothing of the computer it runs on (and may answer for a
    cluster that has nothing to do with it)."""
    return recorded(record).nodes_up(str(record.get("partition") or ""))


def fewer_nodes_overrides(
    settings: RecoveryConfig, record: dict, excluded: list[str], up: list[str] | None
) -> tuple[list[str], str]:
    """(overrides, reason to stop) when excluding ``excluded`` from the nodes ``up`` leaves
    too few: a replanned grid on the nodes left (the global batch is kept; the checkpoint
    is resharded), or waiting for the nodes, or stopping, as ``recovery.on_fewer_nodes``
    says."""
    needed = int(record.get("nodes") or 0)
    if not needed or up is None:
        return [], ""
    left = [n for n in up if n not in excluded]
    if len(left) >= needed or settings.on_fewer_nodes == "wait":
        return [], ""
    if settings.on_fewer_nodes == "stop" or not left:
        return [], f"recovery.on_fewer_nodes=stop: {len(left)} of {needed} nodes left"
    return [f"nodes={len(left)}", "grid=auto"], ""


def exclusion(
    job_dir: Path,
    record: dict,
    failed: list[str],
    up: list[str] | None,
    by_user: tuple[str, ...] = (),
) -> tuple[list[str], list[str]]:
    """The nodes the next attempt leaves out: this failure's, those the user's own launch
    left out (``by_user``: always), and those excluded before that are not in ``up``; and
    the override that says so when an excluded node is back in service (it is used again;
    otherwise the exclusions of earlier attempts carry over)."""
    new = list(dict.fromkeys(failed))
    earlier = [n for n in excluded_nodes(original_overrides(job_dir, record)) if n not in new]
    if not earlier or up is None:
        return new + earlier, []
    still_down = [n for n in earlier if n not in up or n in by_user]
    if still_down == earlier:
        return new + earlier, []
    kept = new + still_down
    return kept, [f"{EXCLUDE_KEY}={','.join(kept)}"]


def grow_overrides(
    record: dict, root_record: dict, excluded: list[str], up: list[str] | None
) -> list[str]:
    """A run shrunk by an earlier attempt grows again when nodes came back: the planner's
    grid for as many nodes as are ``up`` (without ``excluded``), up to what the run's first
    attempt asked for."""
    wanted, now = int(root_record.get("nodes") or 0), int(record.get("nodes") or 0)
    if now >= wanted or up is None:
        return []
    left = [n for n in up if n not in excluded]
    return [f"nodes={min(wanted, len(left))}", "grid=auto"] if len(left) > now else []


def spare_overrides(record: dict, excluded: list[str], up: list[str] | None) -> list[str]:
    """Fewer spare nodes for the next attempt when the partition's nodes ``up``, less
    ``excluded``, cannot hold the grid's nodes and all its spares (a lost batch host of a
    1-node run with one spare on 2 nodes): as many spares as fit, none at worst."""
    spares = int((record.get(RECORD_KEY) or {}).get("spare_nodes") or 0)
    if not spares or up is None:
        return []
    left = len([n for n in up if n not in excluded]) - int(record.get("nodes") or 0)
    return [f"recovery.spare_nodes={max(0, left)}"] if left < spares else []


UNREACHABLE_WAIT_S, UNREACHABLE_POLL_S = 8 * 60.0, 15.0  # within the recovery job's limit


def status_once_reachable(
    job_dir: Path, wait_s: float = UNREACHABLE_WAIT_S, poll_s: float = UNREACHABLE_POLL_S
) -> JobStatus:
    """The ended attempt's status, asked again while Slurm cannot be reached or still
    calls the job active (up to ``wait_s``; sacct may lag the job's end that started this
    step): an attempt whose end Slurm cannot confirm is never classed."""
    deadline = time.monotonic() + wait_s
    while True:
        (status,) = collect([str(job_dir)])
        settled = not status.unreachable and status.failure != failures.RUNNING
        if settled or time.monotonic() >= deadline:
            return status
        time.sleep(poll_s)


def goodput_written(root: Path) -> str:
    """The run's goodput into its TensorBoard folder, written by its last recovery step
    (afterany: it runs once the allocation has ended, so sacct knows its end); '' or
    "; <why not>" in one line. Nothing is raised: ``jobs status`` can still write it."""
    try:
        said = curves.log_run_at_end(attempts_of(root))
    except Exception as exc:  # noqa: BLE001 (the run is done; this is a record only)
        said = [f"goodput not written: {type(exc).__name__}: {exc}"]
    return "".join(f"; {line}" for line in said)


def recover(job_dir: Path, out=sys.stdout) -> str:
    """The recovery step for the failed attempt in ``job_dir``; returns its one line."""
    job_dir = Path(job_dir).resolve()
    record = read_record(job_dir)
    settings = settings_of(record)
    root = run_root(job_dir, record)
    chain_record = chain_of(root)
    if chain_record.get("state") == STOPPED:
        return f"{root}: stopped ({chain_record.get('stop', {}).get('reason', 'jobs stop')})"
    status = status_once_reachable(job_dir)
    if status.unreachable:  # never a verdict from Slurm's silence: the run is left as it is
        return f"{root}: {status.reason} ({status.unreachable}); nothing done"
    if status.failure == failures.COMPLETED:
        set_chain(root, settings, state=DONE)
        return f"{root}: completed{goodput_written(root)}"
    if status.failure == failures.RUNNING:  # its end never reached sacct: no verdict
        return f"{root}: Slurm still calls job {status.job_id} {status.state}; nothing done"
    action = policy_of(settings, status.failure)
    if status.slow_nodes and action == RESUME:
        action = RESUME_EXCLUDE  # the preflight named slow nodes: leave them out
    status, action = with_stragglers(settings, status, action, job_dir)
    if action == RESUME:  # the policy says a plain resume: on the same nodes
        status = replace(status, bad_nodes=[])
    history = list(chain_record.get("attempts", []))
    ended = {"job_dir": str(job_dir), "job_id": status.job_id, "class": status.failure,
             "action": action, "step": status.step, "reason": status.reason,
             "failed_step": status.detail.get("step"), "checkpointed": checkpointed_step(job_dir),
             "ended_at": time.time(), FAILURE_KEY: failure_key(status.job_id, record)}  # fmt: skip
    attempts = with_attempt(history, ended)
    started = float(chain_record.get("started_at") or record.get("submitted_at") or time.time())
    why = f"{status.failure}: policy {action}" if action == STOP else ""
    why = why or limit_reached(settings, attempts, started)
    up = nodes_up(record)  # one sinfo call for the exclusions, a shrink or a growth
    by_user = tuple(excluded_nodes(original_overrides(root, read_record_or_empty(root))))
    failed = status.bad_nodes + status.slow_nodes
    excluded, readmit = exclusion(job_dir, record, failed, up, by_user)
    overrides, fewer = fewer_nodes_overrides(settings, record, excluded, up)
    if not overrides and root != job_dir:
        overrides = grow_overrides(record, read_record_or_empty(root), excluded, up)
    overrides += readmit + spare_overrides(record, excluded, up)
    why = why or fewer
    if not why and action == ROLLBACK:
        before = [a for a in history if a.get(FAILURE_KEY) != ended[FAILURE_KEY]]
        why = rollback(job_dir, status, before)  # not this failure's own entry
    if why:
        stop = {"reason": why, "class": status.failure, "attempt": len(attempts)}
        set_chain(root, settings, state=STOPPED, attempts=attempts, stop=stop)
        return f"{root}: stop: {why}"
    set_chain(root, settings, state=RECOVERING, attempts=attempts, started_at=started)
    time.sleep(settings.backoff_s)
    if chain_of(root).get("state") == STOPPED:  # jobs stop during the backoff
        return f"{root}: stopped during the backoff"
    return resubmit(status, job_dir, root, settings, overrides, out)


def resubmit(status, job_dir: Path, root: Path, settings: RecoveryConfig,
             overrides: list[str], out) -> str:  # fmt: skip
    args = argparse.Namespace(overrides=overrides, dry_run=False, only=None, wait=False,
                              max_attempts=settings.max_attempts + 1, decided=True)  # fmt: skip
    line = resubmit_one(status, args, out)
    target = read_record_or_empty(job_dir).get("resubmitted_as")
    if target and line.startswith("resubmitted"):
        carry_skipped_steps(job_dir, Path(target))
        set_chain(root, settings, state=RUNNING, current=target)
    elif chain_of(root).get("state") != STOPPED:  # a jobs stop meanwhile keeps its reason
        set_chain(root, settings, state=STOPPED, stop={"reason": line, "class": status.failure})
    return line


def main(argv: list[str] | None = None) -> int:
    """The recovery job's process: ``python -m axonn_launch.recover <attempt dir>``, the
    command the recovery script names (``submit/chain.py``). People need not call it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m axonn_launch.recover <attempt dir>", file=sys.stderr)
        return 2
    try:
        print(recover(Path(args[0])), flush=True)
    except Exception as exc:  # the chain must end in a state, never hang in "recovering"
        print(stop_after_error(Path(args[0]), exc), file=sys.stderr, flush=True)
        return 1
    return 0


def stop_after_error(job_dir: Path, exc: Exception) -> str:
    """Stop the run whose recovery step failed, saying why in one line."""
    why = f"the recovery step failed: {type(exc).__name__}: {exc}".splitlines()[0]
    try:
        record = read_record(job_dir)
        root = run_root(job_dir.resolve(), record)
        set_chain(root, settings_of(read_record(root)), state=STOPPED,
                  stop={"reason": why, "class": str(record.get("failure", ""))})  # fmt: skip
    except (OSError, ValueError) as error:
        return f"{why} (and its record could not be written: {error})"
    return f"{root}: stop: {why}"
