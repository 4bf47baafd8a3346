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

from pathlib import Path

from axonn_launch.common.jobdir import read_failures
from axonn_launch.records.failures import PEER_LOST_PATTERNS, first_match


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
