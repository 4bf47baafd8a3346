"""Where a run's allocated time went, across all of its attempts.

Each attempt's allocation (Slurm: sacct's Start to End; a local job: its launch to the
supervisor's end) is cut into parts by rank 0's timeline of that attempt (``timeline.jsonl``:
every optimizer step and every checkpoint save, with wall-clock start and end):

- ``startup``: the fixed cost of an allocation outside the training: the first attempt's
  allocation start to its first step (modules, set-up, preflight, imports,
  initialization), and the finished run's last attempt after its last step or save (what
  runs after the training, the final record, srun's end);
- ``useful``: steps whose result the finished run keeps;
- ``lost``: steps recomputed later, because a failure came before the next checkpoint (a
  later attempt ran them again from an older step);
- ``checkpoint``: the training held by checkpoint saves;
- ``recovery``: what a failure costs in allocated time: the failed attempt's allocation
  after its last step or save, and the next attempt's start-up to its first step.

The parts add up to the allocated time by construction: each second of an allocation
belongs to exactly one part (a gap between two events belongs to the later one). Time in
the queue is not allocated and is reported apart (``queue_s``), and so is the time to
recovery of each failure (``ttr_s``: from the failed attempt's end to the next attempt's
first step, queue and backoff included). Goodput is useful time over allocated time;
times are wall-clock seconds of the allocation, not node-seconds.

Login-node code: never imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from axonn_launch.common.durations import duration
from axonn_launch.common.jobdir import read_timeline

PARTS = ("useful", "lost", "startup", "checkpoint", "recovery")


@dataclass(frozen=True)
class Allocation:
    """One attempt: its dir and its allocation's submit, start and end (unix seconds)."""

    job_dir: Path
    submit: float
    start: float
    end: float


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
    ttr_s: list[float] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.useful_s / self.allocated_s if self.allocated_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "goodput": self.goodput}

    def add(self, part: str, seconds: float) -> None:
        name = f"{part}_s"
        setattr(self, name, getattr(self, name) + max(0.0, seconds))


def of_run(attempts: list[Allocation], finished: bool) -> Goodput | None:
    """The goodput of a run whose attempts, in order, all ended (None when an attempt left
    no timeline: it never reached a first step, or its ranks wrote none)."""
    timelines = [sorted(read_timeline(a.job_dir), key=lambda e: e["start"]) for a in attempts]
    first_steps = [next((int(e["step"]) for e in t if "step" in e), None) for t in timelines]
    result = Goodput()
    for i, (attempt, events) in enumerate(zip(attempts, timelines)):
        last = i == len(attempts) - 1
        later = [s for s in first_steps[i + 1 :] if s is not None]
        redo_from = min(later) if later else None
        if last and not finished:
            redo_from = last_saved(events) + 1
        split_attempt(result, attempt, events, redo_from, first=i == 0, done=last and finished)
        result.queue_s += max(0.0, attempt.start - attempt.submit)
        if i and events:
            result.ttr_s.append(events[0]["start"] - attempts[i - 1].end)
    return result if any(timelines) else None


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
) -> None:
    """Add one attempt's allocation, cut into parts, to ``result``."""
    result.allocated_s += attempt.end - attempt.start
    cursor = attempt.start
    for n, event in enumerate(events):
        start = min(max(event["start"], cursor), attempt.end)
        end = min(max(event["end"], start), attempt.end)
        if n == 0:
            result.add("startup" if first else "recovery", start - cursor)
            cursor = start
        part = part_of(event, redo_from)
        result.add(part, end - cursor)
        if part == "lost":
            result.lost_steps += 1
        cursor = end
    result.add("startup" if done else "recovery", attempt.end - cursor)


def part_of(event: dict, redo_from: int | None) -> str:
    if "checkpoint" in event:
        return "checkpoint"
    if redo_from is not None and int(event["step"]) >= redo_from:
        return "lost"
    return "useful"


def describe(found: dict) -> str:
    """One line: ``goodput 61% of 3.2 min allocated: useful ..., lost ... (4 steps), ...``."""
    parts = ", ".join(
        f"{name.replace('startup', 'start-up')} {duration(found[f'{name}_s'])}"
        + (f" ({found['lost_steps']} steps)" if name == "lost" and found["lost_steps"] else "")
        for name in PARTS
    )
    line = f"goodput {found['goodput']:.0%} of {duration(found['allocated_s'])} allocated: {parts}"
    line += f"; queued {duration(found['queue_s'])}"
    if found["ttr_s"]:
        ttr = ", ".join(duration(t) for t in found["ttr_s"])
        line += f"; time to recovery {ttr}"
    return line
