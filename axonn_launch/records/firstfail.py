"""The first failing rank: each rank that raises leaves a record; readers name the first.

When one rank fails, its peers fail too, a moment later, with lost connections or
aborted collectives. Their noise reaches the console first (rank 0 owns it on
``machine=local``), while the cause sits in another rank's log. So every rank that
raises writes ``<job_dir>/logs/failures/rank_<N>.json`` (rank, host, time, the exception
line and the last lines of its traceback), and ``first_failure`` picks the earliest
record that is not a lost-peer symptom (or the earliest of all). The launcher prints it
when a local job fails; ``jobs status`` shows it. Torch-free: the login node reads these.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path

from axonn_launch.records.failures import PEER_LOST_PATTERNS, first_match

TAIL_LINES = 8


def failure_dir(job_dir: str | Path) -> Path:
    return Path(job_dir) / "logs" / "failures"


def record_failure(job_dir: str | Path, rank: int, error: BaseException) -> None:
    """Called by a rank that is about to die of ``error``; never raises itself."""
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    text = "".join(lines).rstrip().splitlines()
    record = {
        "rank": rank,
        "host": socket.gethostname(),
        "time": time.time(),
        "exception": f"{type(error).__name__}: {error}".splitlines()[0][:500],
        "tail": text[-TAIL_LINES:],
    }
    try:
        folder = failure_dir(job_dir)
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / f".rank_{rank}.json.{os.getpid()}"
        part.write_text(json.dumps(record))
        part.replace(folder / f"rank_{rank}.json")
    except OSError:
        pass  # the traceback still reaches the rank's own log


def read_failures(job_dir: str | Path) -> list[dict]:
    records = []
    for path in failure_dir(job_dir).glob("rank_*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: (r.get("time", 0.0), r.get("rank", 0)))


def is_symptom(record: dict) -> bool:
    """A rank that only saw a peer go away."""
    text = "\n".join([record.get("exception", ""), *record.get("tail", [])])
    return first_match(text, PEER_LOST_PATTERNS) is not None


def first_failure(job_dir: str | Path) -> dict | None:
    records = read_failures(job_dir)
    causes = [r for r in records if not is_symptom(r)]
    return (causes or records or [None])[0]


def headline(record: dict) -> str:
    """``rank 1 (host n1) failed first: ValueError: ...``"""
    return f"rank {record['rank']} (host {record['host']}) failed first: {record['exception']}"


def describe(record: dict) -> str:
    """The headline and the traceback's last lines, indented."""
    return "\n".join([headline(record), *(f"  {line}" for line in record.get("tail", []))])
