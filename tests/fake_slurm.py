"""Stand-ins for Slurm's commands, for the tests outside tests/slurm/ that need one on PATH
(tests/slurm/ runs the real ones on the local cluster).

``fake_tools(bindir, {"sacct": printing("1|FAILED|1:0|n1"), "sbatch": SUBMITTED})`` writes
one script per tool; ``calls=FILE`` makes each append ``<tool> <arguments>`` to FILE first.
``on_path(bindir)`` is the PATH that finds them before any real one.
"""

from __future__ import annotations

import os
from pathlib import Path

SUBMITTED = "echo 'Submitted batch job 1'"  # sbatch's answer, as submitit reads it
QUIET = "true"  # a tool that prints nothing (squeue: no job queued)


def printing(text: str) -> str:
    """A body that prints ``text`` as it is."""
    return f"cat <<'EOF'\n{text}\nEOF"


def failing(said: str, code: int = 1) -> str:
    """A body that says ``said`` on stderr and fails."""
    return f"echo '{said}' >&2; exit {code}"


def fake_tools(
    bindir: Path, tools: dict[str, str], *, calls: Path | None = None, shell: str = "/bin/sh"
) -> Path:
    """Write each of ``tools`` (name -> script body, run by ``shell``) into ``bindir``."""
    bindir.mkdir(parents=True, exist_ok=True)
    for name, body in tools.items():
        logged = f'echo "{name} $*" >> "{calls}"\n' if calls else ""
        (bindir / name).write_text(f"#!{shell}\n{logged}{body}\n")
        (bindir / name).chmod(0o755)
    return bindir


def on_path(bindir: Path, path: str | None = None) -> str:
    """``bindir`` first, then ``path`` (this process's PATH)."""
    return f"{bindir}{os.pathsep}{os.environ['PATH'] if path is None else path}"
