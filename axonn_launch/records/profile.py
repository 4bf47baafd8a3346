"""What a ``train.profile.steps`` window's traces say: per rank, the time in collectives
against the rest, and the ops or kernels whose own time was longest (``report``'s table).

On GPUs the kernels decide (category ``kernel``): NCCL/RCCL kernels are communication,
every other kernel compute. On CPUs (gloo) there are no kernels: communication is the
union of the ``c10d::`` and ``gloo:`` ops' intervals on the rank's threads, compute the
rest of the window (first event to last). Reads the Chrome trace JSON that
``torch.profiler`` exports (train/health/profile.py); login-node code, never imports torch.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from axonn_launch.common.jobdir import PROFILE_TRACE, JobPaths

COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")
COMM_KERNELS = ("nccl", "rccl")
US = 1e-6  # trace times are microseconds


@dataclass(frozen=True)
class RankProfile:
    rank: int
    window_s: float
    comm_s: float
    compute_s: float
    top: tuple[tuple[str, float], ...]  # (name, own seconds), longest first
    on_gpu: bool


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by (start, end) microsecond intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total * US


def self_times(events: list[dict]) -> Counter[str]:
    """Seconds per op name, each event's own time (less the events nested in it on its
    thread): a wrapper op does not count its children's work again."""
    totals: Counter[str] = Counter()
    stacks: dict[tuple, list[dict]] = {}
    for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        stack = stacks.setdefault((event.get("pid"), event.get("tid")), [])
        while stack and event["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
            stack.pop()
        if stack and event["ts"] + event["dur"] <= stack[-1]["ts"] + stack[-1]["dur"]:
            totals[stack[-1]["name"]] -= event["dur"] * US  # nested: not the parent's own
        totals[event["name"]] += event["dur"] * US
        stack.append(event)
    return totals


def rank_profile(rank: int, trace: dict, top: int = 3) -> RankProfile:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    window = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    if kernels:
        comm = [e for e in kernels if any(k in e["name"].lower() for k in COMM_KERNELS)]
        comm_s = union_s([(e["ts"], e["ts"] + e["dur"]) for e in comm])
        compute_s = union_s([(e["ts"], e["ts"] + e["dur"]) for e in kernels if e not in comm])
        ranked = kernels
    else:
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        comm = [e for e in ops if e["name"].startswith(COMM_PREFIXES)]
        comm_s = union_s([(e["ts"], e["ts"] + e["dur"]) for e in comm])
        compute_s = window * US - comm_s
        ranked = ops
    longest = tuple(self_times(ranked).most_common(top))
    return RankProfile(rank, window * US, comm_s, compute_s, longest, bool(kernels))


def read_profiles(job_dir: Path) -> list[RankProfile]:
    """Every rank's trace of the job's profile window, by rank ([] without one)."""
    found = []
    for path in JobPaths(job_dir).profile.glob(PROFILE_TRACE.format(rank="*")):
        rank = path.stem.rpartition("rank")[2]
        if rank.isdigit():
            found.append(rank_profile(int(rank), json.loads(path.read_text())))
    return sorted(found, key=lambda p: p.rank)


PROFILE_HEADER = ("rank", "window s", "collectives s", "collectives", "compute s", "longest")


def profile_rows(profiles: list[RankProfile]) -> list[tuple[str, ...]]:
    """``report``'s table: one row per rank."""
    return [
        (str(p.rank), f"{p.window_s:.3f}", f"{p.comm_s:.3f}",
         f"{p.comm_s / p.window_s:.0%}" if p.window_s else "-", f"{p.compute_s:.3f}",
         ", ".join(f"{name} {seconds:.3f}" for name, seconds in p.top))
        for p in profiles
    ]  # fmt: skip
