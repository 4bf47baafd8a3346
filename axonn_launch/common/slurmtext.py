"""Slurm's text, read in one place: host lists, job states, and sacct/squeue output.

Pure functions on strings, used by the launcher (``slurm``, ``jobs``, ``failures``) and by
the job itself (``train.bootstrap``): no torch, no submitit, no subprocess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

# States of a job that is not over yet (sacct and squeue spell them alike). A job held
# after a requeue or a deleted reservation is waiting, not ended.
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "STOPPED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESV_DEL_HOLD",
    }
)
# What sacct prints for a job's NodeList before it has nodes.
NO_NODES = frozenset({"", "None", "None assigned", "(null)"})

SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Submit", "Start", "End")
SQUEUE_FORMAT = "%i|%T|%N"  # job id, long state, node list


@dataclass(frozen=True)
class JobRow:
    """One job as sacct or squeue reports it (squeue has no exit code)."""

    state: str = ""
    exit_code: str = ""
    nodelist: str = ""
    times: tuple[float, float, float] | None = None  # submit, start, end (sacct; unix s)


def base_state(state: str) -> str:
    """``CANCELLED by 0`` -> ``CANCELLED``; ``RUNNING+`` -> ``RUNNING``; ``""`` -> ``""``."""
    words = (state or "").split()
    return words[0].rstrip("+").upper() if words else ""


# sinfo's short node states (``%t``) of a node that can run no job, and the flags Slurm
# appends to a state (``*`` not responding, ``~`` powered off, ``#`` powering up, ``!``
# pending power-down, ``%`` powering down, ``$`` maintenance, ``@`` pending reboot, ``^``
# rebooting, ``-`` planned by the backfill scheduler)
NODE_DOWN_STATES = frozenset(
    {"down", "drain", "drng", "fail", "failg", "maint", "unk", "no_respond"}
)
NODE_STATE_FLAGS = "*~#!%$@^-"


def node_down(state: str) -> bool:
    """Whether sinfo's ``%t`` state of a node (``drain*``, ``down~``, ``idle``) says it can
    run no job; its trailing flags do not count."""
    return state.rstrip(NODE_STATE_FLAGS).lower() in NODE_DOWN_STATES


def is_active(state: str) -> bool:
    """True while Slurm may still run the job (queued, running, held or requeued)."""
    return base_state(state) in ACTIVE_STATES


def expand_hostlist(hostlist: str) -> list[str]:
    """``a1,b[3,5-6]`` -> ``a1 b3 b5 b6``; keeps zero padding; several bracket groups
    multiply out (``rack[1-2]-n[01-02]`` is four hosts). Malformed text raises ValueError."""
    hosts: list[str] = []
    for pattern in _split_top_level(hostlist):
        hosts.extend(_expand_pattern(pattern))
    return hosts


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """A sacct/squeue NodeList field as host names; none for a job without nodes."""
    text = (nodelist or "").strip()
    return () if text in NO_NODES else tuple(expand_hostlist(text))


def _split_top_level(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in host list {text!r}")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced brackets in host list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_pattern(pattern: str) -> list[str]:
    """Expand every bracket group of one host pattern."""
    open_at = pattern.find("[")
    if open_at < 0:
        return [pattern]
    close_at = pattern.index("]", open_at)
    prefix, ranges, rest = (
        pattern[:open_at],
        pattern[open_at + 1 : close_at],
        pattern[close_at + 1 :],
    )
    tails = _expand_pattern(rest)
    return [prefix + value + tail for value in _expand_ranges(ranges) for tail in tails]


def _expand_ranges(ranges: str) -> list[str]:
    """``1-3,07`` -> ``1 2 3 07``: a range keeps the width of its lower bound."""
    values: list[str] = []
    for item in ranges.split(","):
        low, dash, high = item.strip().partition("-")
        if not re.fullmatch(r"\d+", low) or (dash and not re.fullmatch(r"\d+", high)):
            raise ValueError(f"bad range {item!r} in host list")
        if not dash:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"descending range {item!r} in host list")
        values.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return values


def parse_sacct(text: str) -> dict[str, JobRow]:
    """Rows of ``sacct -X -n -P -o JobID,State,ExitCode,NodeList,Submit,Start,End`` by job
    id; ``times`` only once the job has ended (sacct says Unknown before). A row without
    the three times (an older caller's field list) still gives the state."""
    rows = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) in (4, len(SACCT_FIELDS)) and parts[0]:
            times = sacct_times(parts[4:7]) if len(parts) == len(SACCT_FIELDS) else None
            rows[parts[0]] = JobRow(parts[1], parts[2], parts[3], times)
    return rows


def sacct_times(fields: list[str]) -> tuple[float, float, float] | None:
    """sacct's Submit, Start and End (``2026-12-03T06:30:01``, the local time zone) as unix
    seconds; None while any is Unknown or None."""
    try:
        stamps = [datetime.strptime(f, "%Y-%m-%dT%H:%M:%S").timestamp() for f in fields]
    except ValueError:
        return None
    submit, start, end = stamps
    return (submit, start, end) if submit <= start <= end else None


def parse_squeue(text: str) -> dict[str, JobRow]:
    """Rows of ``squeue -h -o '%i|%T|%N'`` by job id (queued and running jobs only)."""
    rows = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[0]:
            rows[parts[0]] = JobRow(parts[1], "", parts[2])
    return rows


# Whose job an id is (submit/chain.py checks it before cancelling): id, name, stdout path.
# ``StdOut`` is the --output pattern as given (``%j`` unexpanded); it comes last, so a
# ``|`` in a path cannot shift the other fields.
SQUEUE_OWNER_FORMAT = "JobID:|,Name:|,StdOut:"


def parse_squeue_owners(text: str) -> dict[str, tuple[str, str]]:
    """``squeue -h -O JobID:|,Name:|,StdOut:`` as job id -> (name, stdout pattern), for the
    jobs still queued or running."""
    rows = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) == 3 and parts[0]:
            rows[parts[0]] = (parts[1], parts[2])
    return rows


# --- text the launcher writes into a batch script ---------------------------------------
# C0 controls and DEL: a newline or carriage return would end an ``#SBATCH`` line early (the
# rest becomes a shell line, and the ``#SBATCH`` block ends there); NUL and the others have
# no place in a partition, an account, a path or an option either.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")
# submitit's own placeholders in its folder (``%j`` job id, ``%t`` task, ``%A``/``%a`` array):
# it replaces them wherever they appear in the path, the job dir's part included.
SUBMITIT_TAGS = ("%j", "%t", "%A", "%a")


def control_characters(text: str) -> str:
    """The control characters in ``text``, as ``repr`` shows them (``'\\n'``); '' when none."""
    found = dict.fromkeys(CONTROL_CHARACTERS.findall(text))
    return ", ".join(repr(c) for c in found)


def escape_percent(path: str) -> str:
    """``path`` for a Slurm filename pattern (--output, --error, --chdir) that expands
    nothing in it: each ``%`` doubled (``%%`` is Slurm's literal ``%``), so that a job dir
    named ``run%x`` is not read as ``run<job name>``."""
    return path.replace("%", "%%")
