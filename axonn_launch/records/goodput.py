"""Where a run's allocated time went, across all of its attempts.

Each attempt's allocation is cut by rank 0's timeline into ``startup``, ``useful``,
``lost``, ``checkpoint`` and ``recovery``, which add up to the allocated time; queue time
and each failure's time to recovery are reported apart. Goodput is useful time over
allocated time. Login-node code: never imports torch.

What each part holds, and how requeued allocations count: ``docs/recovery.md``
("records/goodput.py").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from axonn_launch.common.durations import duration
from axonn_launch.common.failure_classes import HANG
from axonn_launch.common.jobdir import JobPaths, metrics_row, read_failures, read_timeline

PARTS = ("useful", "lost", "startup", "checkpoint", "recovery")
# A step this many times the allocation's median is a stall beyond the median (the
# watchdog's default train.watchdog.step_factor: past it, a step that never ended is a hang).
STALL_FACTOR = 10.0
# The first steps of an allocation are slow by nature (warm-up, GEMM tuning), as the
# watchdog's train.watchdog.startup_steps grants; steps that evaluated are longer too.
STARTUP_STEPS = 2
CLOCK_SLACK_S = 60.0  # a rank's clock against the scheduler's


@dataclass(frozen=True)
class Allocation:
    """One allocation of an attempt: its dir and the allocation's submit, start and end
    (unix seconds)."""

    job_dir: Path
    submit: float
    start: float
    end: float
    nodes: int = 0  # the nodes it held, as charged (0: unknown)


@dataclass
class Goodput:
    allocated_s: float = 0.0
    useful_s: float = 0.0
    lost_s: float = 0.0
    startup_s: float = 0.0
    checkpoint_s: float = 0.0
    recovery_s: float = 0.0
    queue_s: float = 0.0
    lost_steps: int = 0
    stalled_s: float = 0.0  # the part of lost_s that no rank made progress in
    ttr_s: list[float] = field(default_factory=list)
    # what the sites charge (Frontier, Perlmutter and Alps bill node-hours): each
    # allocation's nodes times its time, queue left out
    node_hours: float = 0.0

    @property
    def goodput(self) -> float:
        return self.useful_s / self.allocated_s if self.allocated_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "goodput": self.goodput}

    def add(self, part: str, seconds: float) -> None:
        name = f"{part}_s"
        setattr(self, name, getattr(self, name) + max(0.0, seconds))


def of_run(attempts: list[Allocation], finished: bool) -> Goodput | None:
    """The goodput of a run whose allocations, in order, all ended (None when an attempt
    left no timeline: it never reached a first step, or its ranks wrote none). An attempt
    requeued in place gives one ``Allocation`` per allocation, in order."""
    windows = allocation_windows(attempts)
    timelines = allocation_timelines(attempts, windows)
    first_steps = [next((int(e["step"]) for e in t if "step" in e), None) for t in timelines]
    result = Goodput()
    for i, (attempt, events) in enumerate(zip(attempts, timelines)):
        last = i == len(attempts) - 1
        later = [s for s in first_steps[i + 1 :] if s is not None]
        redo_from = min(later) if later else None
        if last and not finished:
            redo_from = last_saved(events) + 1
        stalls = Stalls(slow_steps(attempt.job_dir, events), hung_since(attempt, windows[i]))
        split_attempt(result, attempt, events, redo_from, first=i == 0, done=last and finished,
                      stalls=stalls)  # fmt: skip
        waited_from = max(attempt.submit, attempts[i - 1].end) if i else attempt.submit
        result.queue_s += max(0.0, attempt.start - waited_from)
        if i and events:
            result.ttr_s.append(events[0]["start"] - attempts[i - 1].end)
    return result if any(timelines) else None


def allocation_windows(attempts: list[Allocation]) -> list[tuple[float, float]]:
    """The part of its job dir's history each allocation owns: from its start (the dir's
    first allocation: from the beginning) to the start of the dir's next allocation."""
    windows = []
    for i, attempt in enumerate(attempts):
        first_of_dir = all(a.job_dir != attempt.job_dir for a in attempts[:i])
        later = [a.start for a in attempts[i + 1 :] if a.job_dir == attempt.job_dir]
        windows.append(
            (-math.inf if first_of_dir else attempt.start, later[0] if later else math.inf)
        )
    return windows


def allocation_timelines(
    attempts: list[Allocation], windows: list[tuple[float, float]]
) -> list[list[dict]]:
    """Each allocation's timeline events, in order (a job dir's read once)."""
    read: dict[Path, list[dict]] = {}
    timelines = []
    for attempt, (low, high) in zip(attempts, windows):
        if attempt.job_dir not in read:
            read[attempt.job_dir] = sorted(read_timeline(attempt.job_dir), key=lambda e: e["start"])
        timelines.append([e for e in read[attempt.job_dir] if low <= e["start"] < high])
    return timelines


@dataclass(frozen=True)
class Stalls:
    """What of an allocation no rank made progress in: each slow step's seconds beyond
    the median (event index -> seconds), and when a hang's section began (None: no hang)."""

    slow: dict[int, float] = field(default_factory=dict)
    hung_since: float | None = None


def slow_steps(job_dir: Path, events: list[dict]) -> dict[int, float]:
    """Steps over ``STALL_FACTOR`` times the allocation's median step: event index ->
    seconds beyond the median. Its first ``STARTUP_STEPS`` steps and the steps that
    evaluated (metrics rows with ``val_loss``) are never stalls."""
    steps = [(n, e) for n, e in enumerate(events) if "step" in e][STARTUP_STEPS:]
    if not steps:
        return {}
    median = statistics.median(e["end"] - e["start"] for _, e in steps)
    slow = {n: e["end"] - e["start"] - median for n, e in steps
            if e["end"] - e["start"] > STALL_FACTOR * median}  # fmt: skip
    if not slow:
        return slow
    evaluated = evaluated_steps(job_dir)
    return {n: t for n, t in slow.items() if int(events[n]["step"]) not in evaluated}


def evaluated_steps(job_dir: Path) -> set[int]:
    """The steps whose metrics row has a validation loss (their timeline step holds it)."""
    try:
        lines = JobPaths(job_dir).metrics.read_text().splitlines()
    except OSError:
        return set()
    rows = (metrics_row(line) for line in lines if "val_loss" in line)
    return {int(r["step"]) for r in rows if r is not None and r.get("val_loss") is not None}


def hung_since(attempt: Allocation, window: tuple[float, float]) -> float | None:
    """When the section that a watchdog found hung in this allocation began (its failure
    record's ``time`` less ``stalled_s``; the earliest of them), or None."""
    low, high = window
    found = []
    for record in read_failures(attempt.job_dir):
        try:
            at, stalled = float(record["time"]), float(record.get("stalled_s", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        inside = attempt.start - CLOCK_SLACK_S <= at <= attempt.end + CLOCK_SLACK_S
        if record.get("failure_class") == HANG and low <= at < high and inside:
            found.append(at - stalled)
    return min(found) if found else None


def last_saved(events: list[dict]) -> int:
    saves = [int(e["checkpoint"]) for e in events if "checkpoint" in e]
    return max(saves) if saves else 0


def split_attempt(
    result: Goodput,
    attempt: Allocation,
    events: list[dict],
    redo_from: int | None,
    *,
    first: bool,
    done: bool,
    stalls: Stalls | None = None,
) -> None:
    """Add one allocation, cut into parts, to ``result``."""
    stalls = stalls or Stalls()
    result.allocated_s += attempt.end - attempt.start
    result.node_hours += attempt.nodes * (attempt.end - attempt.start) / 3600
    cursor = attempt.start
    for n, event in enumerate(events):
        start = min(max(event["start"], cursor), attempt.end)
        end = min(max(event["end"], start), attempt.end)
        if n == 0:
            result.add("startup" if first else "recovery", start - cursor)
            cursor = start
        stalled = min(max(0.0, stalls.slow.get(n, 0.0)), end - cursor)
        add_stall(result, stalled)
        part = part_of(event, redo_from)
        result.add(part, end - cursor - stalled)
        if part == "lost" and "step" in event:
            result.lost_steps += 1
        cursor = end
    tail_end = attempt.end
    if stalls.hung_since is not None:  # from the hung section's start to the end
        tail_end = min(max(stalls.hung_since, cursor), attempt.end)
        add_stall(result, attempt.end - tail_end)
    result.add("startup" if done else "recovery", tail_end - cursor)


def add_stall(result: Goodput, seconds: float) -> None:
    result.add("lost", seconds)
    result.stalled_s += max(0.0, seconds)


def part_of(event: dict, redo_from: int | None) -> str:
    """A save is checkpoint time; a step or an evaluation after it is useful, or lost when
    a later attempt redoes that step."""
    if "checkpoint" in event:
        return "checkpoint"
    step = event["step"] if "step" in event else event["eval"]
    if redo_from is not None and int(step) >= redo_from:
        return "lost"
    return "useful"


def describe(found: dict) -> str:
    """One line: ``goodput 61% of 3.2 min allocated: useful ..., lost ... (4 steps), ...``;
    a stall inside the lost time is named (``lost 12 min (2 steps; 11 min stalled)``)."""
    parts = ", ".join(
        f"{name.replace('startup', 'start-up')} {duration(found[f'{name}_s'])}"
        + (lost_words(found) if name == "lost" else "")
        for name in PARTS
    )
    charged = found.get("node_hours") or 0.0
    hours = f" ({charged:.3g} node-hours)" if charged else ""
    line = (
        f"goodput {found['goodput']:.0%} of {duration(found['allocated_s'])} allocated{hours}:"
        f" {parts}"
    )
    line += f"; queued {duration(found['queue_s'])}"
    if found["ttr_s"]:
        ttr = ", ".join(duration(t) for t in found["ttr_s"])
        line += f"; time to recovery {ttr}"
    return line


def lost_words(found: dict) -> str:
    words = [f"{found['lost_steps']} steps"] if found["lost_steps"] else []
    if found.get("stalled_s"):
        words.append(f"{duration(found['stalled_s'])} stalled")
    return f" ({'; '.join(words)})" if words else ""
