"""One row per run: a run's attempts folded into its newest (the run's state, attempts, last
class, goodput and, once the user stopped it, that), and one line per pack of a packed sweep.

Login-node code: never imports torch.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

from axonn_launch.common.jobdir import PACK_PLAN, PACKS, read_record_or_empty
from axonn_launch.records import failures, goodput
from axonn_launch.records.status import (
    RUN_RUNNING,
    RUN_WAITING,
    JobStatus,
    run_state,
)
from axonn_launch.scheduler.slurm_queries import HELD_WORDS


def runs(rows: list[JobStatus]) -> list[JobStatus]:
    """One row per run: its newest attempt, with the run's attempts, state, last class,
    excluded nodes and (once stopped) why. A run of one attempt keeps its row."""
    grouped: dict[str, list[JobStatus]] = {}
    for row in rows:
        grouped.setdefault(str(Path(row.run_dir or row.job_dir).resolve()), []).append(row)
    shown = []
    for root, group in grouped.items():
        newest = max(group, key=lambda r: r.attempt)
        newest = replace(newest, goodput=goodput_of(group))
        if len(group) == 1 and not newest.run_state:
            shown.append(newest)  # a run of one attempt, without recovery: its row as it is
            continue
        record = read_record_or_empty(Path(root))
        chain = dict(record.get("chain") or {})
        state = run_state(Path(root), record)
        if state == RUN_RUNNING and newest.state.startswith("PENDING"):
            state = RUN_WAITING
        history = chain.get("attempts") or []
        unclassed = newest.failure in ("", "running") and not newest.unreachable
        last = history[-1]["class"] if history and unclassed else ""
        in_place = sum(len(r.restarts_in_place) for r in group)
        shown.append(replace(
            newest, run_state=state, attempts=max(len(group), newest.attempt) + in_place,
            failure=newest.failure or last,
            **{"stop_reason": str((chain.get("stop") or {}).get("reason", "")),
               **user_stop(chain, newest.failure)},
        ))  # fmt: skip
    return shown


USER_STOP = "jobs stop"  # chain.stop's reason (submit/chain.py)
USER_STOP_WORDS = "stopped by the user (python -m axonn_launch.jobs stop)"


def user_stop(chain: dict, failure: str) -> dict:
    """A run that ``jobs stop`` ended: its cancelled attempt was stopped by the user, and
    nothing is to be done (not sacct's ``CANCELLED by <uid>`` and cancelled's resume)."""
    if not chain.get("stopped_by_user") or failure != failures.CANCELLED:
        return {}
    return {"state": f"CANCELLED ({USER_STOP})", "reason": USER_STOP_WORDS,
            "action": failures.STOP, "stop_reason": USER_STOP}  # fmt: skip


def goodput_of(group: list[JobStatus]) -> dict:
    """The run's goodput once all its attempts ended ({} before, or without timelines);
    from its newest extension on (``jobs resubmit <completed> train.steps=N``): the time
    before one was the user's choice, not a loss."""
    attempts = sorted(group, key=lambda r: r.attempt)
    ended = [i for i, r in enumerate(attempts[:-1], 1) if r.failure == failures.COMPLETED]
    attempts = attempts[ended[-1] :] if ended else attempts
    if any(len(r.allocation) != 3 for r in attempts):
        return {}
    allocations = [
        goodput.Allocation(Path(r.job_dir), *times, nodes=r.charged_nodes or r.nodes)
        for r in attempts
        for times in (r.allocations or [r.allocation])
    ]
    found = goodput.of_run(allocations, finished=attempts[-1].failure == failures.COMPLETED)
    return found.as_dict() if found else {}


def pack_lines(paths: list[str], rows: list[JobStatus]) -> list[str]:
    """One line per pack of the packed sweeps under ``paths`` (``submit/pack.py``): its job,
    size and points, with how many of them ended in each class so far."""
    by_dir = {str(Path(r.job_dir).resolve()): r for r in rows}
    lines = []
    for path in paths:
        folder = Path(path) / PACKS
        found = [p for p in folder.glob("*") if p.name.isdigit() and (p / PACK_PLAN).is_file()]
        for pack in sorted(found, key=lambda p: int(p.name)):
            plan = json.loads((pack / PACK_PLAN).read_text())
            points = plan.get("points") or []
            shown = [by_dir.get(str(Path(p["job_dir"]).resolve())) for p in points]
            classes = Counter(pack_word(r) for r in shown if r)
            counted = ", ".join(f"{n} {word}" for word, n in sorted(classes.items()))
            nums = ",".join(str(p["num"]) for p in points)
            job = f"job {plan['job_id']}" if plan.get("job_id") else "not submitted"
            size = (f"{len(points)} array tasks" if plan.get("array")
                    else f"{plan['nodes']} nodes x {plan['minutes']} min")  # fmt: skip
            word = "array" if plan.get("array") else "pack"
            lines.append(f"{word} {pack.name}: {job}, {size}, points {nums}:"
                         f" {counted or 'no status yet'}")  # fmt: skip
    return lines


def pack_word(row: JobStatus) -> str:
    """A packed point's word in its pack's line: its class, ``pending`` while queued (not
    ``running``), or why Slurm holds its pack for good."""
    if row.expected_start.startswith(HELD_WORDS):
        return row.expected_start.split(":")[0]
    return "pending" if row.state.startswith("PENDING") else row.failure or row.state.lower()
