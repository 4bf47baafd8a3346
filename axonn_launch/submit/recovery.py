"""The recovery step (``python -m axonn_launch.recover``): classify the failed attempt, apply
the policy and the limits, shrink the grid when nodes are gone, and resubmit. How the step
is started, and the run's record, are ``submit/chain.py``'s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from axonn_launch.common.jobdir import read_record, read_record_or_empty
from axonn_launch.config.compose import RecoveryConfig
from axonn_launch.records import failures
from axonn_launch.records.status import collect, command_output, run_root_of
from axonn_launch.submit.chain import (
    DONE,
    RECOVERING,
    RESUME,
    RESUME_EXCLUDE,
    RUNNING,
    STOP,
    STOPPED,
    chain_of,
    policy_of,
    set_chain,
    settings_of,
)
from axonn_launch.submit.resubmit import (
    EXCLUDE_KEY,
    excluded_nodes,
    original_overrides,
    resubmit_one,
)

DOWN_STATES = ("down", "drain", "drng", "fail", "failg", "maint", "unk", "no_respond")


def limit_reached(settings: RecoveryConfig, attempts: list[dict], started: float) -> str:
    """Which limit stops the run after these ended attempts ('' if none)."""
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
    hours = (time.time() - started) / 3600
    if settings.budget_h and hours >= settings.budget_h:
        return f"recovery.budget_h={settings.budget_h:g}: {hours:.2f} h spent"
    return ""


def usable_nodes(partition: str) -> list[str] | None:
    """The partition's nodes that are up now (None when sinfo cannot tell)."""
    command = ["sinfo", "-h", "-N", "-o", "%N|%t"] + (["-p", partition] if partition else [])
    text = command_output(command)
    if text is None:
        return None
    up = []
    for line in text.splitlines():
        name, _, state = line.strip().partition("|")
        if name and state.rstrip("*~#!%$@^-").lower() not in DOWN_STATES:
            up.append(name)
    return list(dict.fromkeys(up))


def nodes_up(record: dict) -> list[str] | None:
    """The nodes of the job's partition that are up now; None when sinfo cannot tell, and
    for a local job: sinfo knows nothing of the computer it runs on (and may answer for a
    cluster that has nothing to do with it)."""
    if record.get("scheduler", "slurm") != "slurm":
        return None
    return usable_nodes(str(record.get("partition") or ""))


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
    job_dir: Path, record: dict, failed: list[str], up: list[str] | None
) -> tuple[list[str], list[str]]:
    """The nodes the next attempt leaves out: this failure's, and those excluded before that
    are not in ``up``; and the override that says so when an excluded node is back in
    service (it is used again; otherwise the exclusions of earlier attempts carry over)."""
    new = list(dict.fromkeys(failed))
    earlier = [n for n in excluded_nodes(original_overrides(job_dir, record)) if n not in new]
    if not earlier or up is None:
        return new + earlier, []
    still_down = [n for n in earlier if n not in up]
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


def recover(job_dir: Path, out=sys.stdout) -> str:
    """The recovery step for the failed attempt in ``job_dir``; returns its one line."""
    job_dir = Path(job_dir).resolve()
    record = read_record(job_dir)
    settings = settings_of(record)
    root = run_root_of(job_dir, record)
    chain_record = chain_of(root)
    if chain_record.get("state") == STOPPED:
        return f"{root}: stopped ({chain_record.get('stop', {}).get('reason', 'jobs stop')})"
    (status,) = collect([str(job_dir)])
    if status.failure == failures.COMPLETED:
        set_chain(root, settings, state=DONE)
        return f"{root}: completed"
    action = policy_of(settings, status.failure)
    if status.slow_nodes and action == RESUME:
        action = RESUME_EXCLUDE  # the preflight named slow nodes: leave them out
    ended = {"job_dir": str(job_dir), "job_id": status.job_id, "class": status.failure,
             "action": action, "step": status.step, "reason": status.reason,
             "ended_at": time.time()}  # fmt: skip
    attempts = [*chain_record.get("attempts", []), ended]
    started = float(chain_record.get("started_at") or record.get("submitted_at") or time.time())
    why = f"{status.failure}: policy {action}" if action == STOP else ""
    why = why or limit_reached(settings, attempts, started)
    up = nodes_up(record)  # one sinfo call for the exclusions, a shrink or a growth
    excluded, readmit = exclusion(job_dir, record, status.bad_nodes + status.slow_nodes, up)
    overrides, fewer = fewer_nodes_overrides(settings, record, excluded, up)
    if not overrides and root != job_dir:
        overrides = grow_overrides(record, read_record_or_empty(root), excluded, up)
    overrides += readmit
    why = why or fewer
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
        set_chain(root, settings, state=RUNNING, current=target)
    else:
        set_chain(root, settings, state=STOPPED, stop={"reason": line, "class": status.failure})
    return line
