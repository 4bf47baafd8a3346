"""Running an external tool and reading what it printed: its stdout, or why there is none.

Used by the scheduler objects (``scheduler/slurm.py``, ``slurm_queries.py``), which run every
Slurm command. No torch.
"""

from __future__ import annotations

import subprocess


def command_output(command: list[str]) -> str | None:
    """The stdout of ``command`` if it succeeded, else None (``command_result`` says why)."""
    return command_result(command)[0]


def command_result(command: list[str]) -> tuple[str | None, str]:
    """(stdout, '') of a command that succeeded; (None, why) of one that did not run,
    timed out or failed: its last line on stderr, or its exit code."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, str(error)
    if proc.returncode == 0:
        return proc.stdout, ""
    said = proc.stderr.strip().splitlines()
    last = said[-1].removeprefix(f"{command[0]}: ") if said else f"exit code {proc.returncode}"
    return None, last[:200]
