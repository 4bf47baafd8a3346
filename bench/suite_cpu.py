"""CPU seconds by kind of process over a run of the suite (or anything): a sampler that reads
every process's user+system time from /proc every 0.5 s until it gets SIGTERM, then
writes the totals by kind (a Slurm task's rank, a local job's zygote and its ranks, the
tests' fork-server worlds, the pytest workers, the launcher fork server, Slurm's daemons)
to a JSON file, with the command lines that used most in the kinds that lump several. A
process is counted from when it is first seen (one that was running when the sampler
started, from then); its last half second before it ends is missed, so the totals are a
floor.

    python3 bench/suite_cpu.py cpu.json & S=$!
    AXONN_START_SLURM=1 .venv/bin/python -m pytest; kill $S

Used for "Test suite: what changed, and what is left" in BENCHMARKS.md (third round).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
PERIOD_S = 0.5
KINDS = [  # (a piece of the command line, the kind): the first that matches
    ("submitit.core._submit", "slurm_rank"), ("zygote", "zygote"),
    ("axonn_launch.train", "train_module"), ("pytest", "pytest"),
    ("cli_server", "cli_server"), ("-m axonn_launch", "launcher_cli"),
    ("axonn_launch", "axonn_other"), ("slurmstepd", "slurmstepd"), ("slurmd", "slurmd"),
    ("slurmctld", "slurmctld"), ("slurmdbd", "slurmdbd"), ("mariadb", "mariadb"),
    ("srun", "srun"), ("sbatch", "sbatch"), ("sacct", "sacct"), ("squeue", "squeue"),
    ("scontrol", "scontrol"), ("mpirun", "mpi"), ("prte", "mpi"),
    ("python", "python_other"), ("bash", "bash"),
]  # fmt: skip
LUMPED = ("python_other", "train_module", "axonn_other")


class Process:
    def __init__(self, ticks: int, comm: str, command: str, base: int) -> None:
        self.ticks, self.comm, self.command, self.base = ticks, comm, command, base
        self.kind = kind_of(command)

    def seconds(self) -> float:
        return (self.ticks - self.base) / HZ


def kind_of(command: str) -> str:
    for piece, kind in KINDS:
        if piece in command:
            return kind
    return "other:" + command.split(" ")[0][-30:]


def read(pid: str) -> tuple[str, int, str] | None:
    """(start time, user+system ticks, comm) of ``pid``; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm, _, rest = stat.partition("(")[2].rpartition(")")
    fields = rest.split()
    return fields[19], int(fields[11]) + int(fields[12]), comm


def sample(seen: dict[tuple[str, str], Process], first: bool) -> None:
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        found = read(pid)
        if found is None:
            continue
        start, ticks, comm = found
        known = seen.get((pid, start))
        if known is not None and known.comm == comm:
            known.ticks = ticks
            continue
        try:  # new, or it exec'd another program: its command line again
            command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        base = known.base if known else (ticks if first else 0)
        seen[(pid, start)] = Process(ticks, comm, command, base)


def totals(seen: dict[tuple[str, str], Process]) -> dict:
    by_kind: dict[str, float] = {}
    commands: dict[str, dict[str, float]] = {}
    for process in seen.values():
        by_kind[process.kind] = by_kind.get(process.kind, 0.0) + process.seconds()
        if process.kind in LUMPED:
            top = commands.setdefault(process.kind, {})
            top[process.command[:150]] = top.get(process.command[:150], 0.0) + process.seconds()
    return {
        "cpu_s_by_kind": {
            k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "top_commands": {
            kind: {c: round(s, 1) for c, s in sorted(top.items(), key=lambda kv: -kv[1])[:10]}
            for kind, top in commands.items()
        },
        "processes": len(seen),
    }


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    seen: dict[tuple[str, str], Process] = {}

    def write_and_leave(*_: object) -> None:
        out.write_text(json.dumps(totals(seen), indent=1))
        sys.exit(0)

    signal.signal(signal.SIGTERM, write_and_leave)
    sample(seen, first=True)
    while True:
        time.sleep(PERIOD_S)
        sample(seen, first=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
