"""The watchdog's load on the shared file system, before and after its fixes, in one run.

    .venv/bin/python bench/bench_watchdog_fs.py --ranks 64 --per-node 8 --seconds 10

Each version of ``train/health/watchdog.py`` (``--before``: git revisions, read with
``git show``: before the node relay, before the hang's one collector; after: the working
tree) runs ``--ranks`` watchdogs as threads of one
process, ``--per-node`` to a node, under ``strace -f -e trace=%file``; every file
system call on a path under the job dir (the shared file system) or under the node-local
folder between the phase's start and end is counted (start-up left out). Two phases:
steady state (every rank in a long section for
``--seconds``), and a hang (every rank's deadline passes at once, one more rank is
silent: each fires and names it; the reads of heartbeat files, and the ranks that made
them, are counted apart). The counts are
syscalls, not times (no pairs needed); the steady figures are scaled to the job's
``beat_s`` of 2 s, per rank per minute. Writes bench/results/bench_watchdog_fs.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODULE = "axonn_launch/train/health/watchdog.py"
# the versions compared: before the node relay, before the hang's one collector
BEFORE_WORDS = {"3d13763^": "no relay, no collector", "adc8f9c": "the relay, no collector"}
JOB_BEAT_S = 2.0  # the job's default train.watchdog.beat_s
PATH_ARG = re.compile(r'"([^"]+)"')
HEARTBEAT = re.compile(r"/heartbeats/rank_\d+\.json$")


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"watchdog_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def worker(args: argparse.Namespace) -> None:
    """One phase, in the process strace follows."""
    from axonn_launch.common.spec import WatchdogConfig

    wd = load(Path(args.module))
    cfg = WatchdogConfig(beat_s=args.beat, startup_s=3600, step_floor_s=3600)
    fired = threading.Semaphore(0)
    world = args.ranks + (1 if args.phase == "hang" else 0)
    dogs = [wd.Watchdog(cfg, args.job_dir, rank=r, world_size=world, node=f"n{r // args.per_node}",
                        end=lambda code: fired.release()) for r in range(args.ranks)]  # fmt: skip
    if args.phase == "hang":  # the silent rank left its start-up heartbeat only
        wd.Watchdog(
            cfg, args.job_dir, rank=args.ranks, world_size=world, node="nx"
        ).write_heartbeat()
    for dog in dogs:
        dog.start()
    marker("START")
    if args.phase == "steady":
        time.sleep(args.seconds)
    else:
        for dog in dogs:
            dog.enter("sync", 5, args.beat)
        for _ in dogs:
            fired.acquire(timeout=120)
    marker("END")
    for dog in dogs:
        dog.stopping.set()


def marker(name: str) -> None:
    """A line in the trace: what lies between START and END is counted."""
    Path(f"/axonn-bench-{name}").exists()


def count(trace: Path, job_dir: str, node_dir: str) -> dict[str, int]:
    """File system calls on the shared job dir and on the node-local folder, after START."""
    found = {"shared": 0, "shared_stat": 0, "shared_read": 0, "shared_write": 0, "node": 0,
             "heartbeat_reads": 0}  # fmt: skip
    touching: set[str] = set()  # the threads (ranks) that touched the shared file system
    readers: set[str] = set()  # the threads that read a heartbeat file
    lines = trace.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if "/axonn-bench-START" in line)
    last = next(i for i, line in enumerate(lines) if "/axonn-bench-END" in line)
    for line in lines[first:last]:
        paths = PATH_ARG.findall(line)
        if not paths or "resumed>" in line:
            continue
        call = line.split(None, 1)[-1].split("(", 1)[0]
        if paths[0].startswith(job_dir):
            found["shared"] += 1
            touching.add(line.split(None, 1)[0])
            kind = "stat" if "stat" in call else "read" if "O_RDONLY" in line else "write"
            found[f"shared_{kind}"] += 1
            if kind == "read" and HEARTBEAT.search(paths[0]):
                found["heartbeat_reads"] += 1
                readers.add(line.split(None, 1)[0])
        elif paths[0].startswith(node_dir):
            found["node"] += 1
    return found | {"ranks_touching": len(touching), "heartbeat_readers": len(readers)}


def run_phase(version: str, module: Path, phase: str, args: argparse.Namespace) -> dict:
    ranks, beat = (
        (args.ranks, args.beat) if phase == "steady" else (args.hang_ranks, args.hang_beat)
    )
    with tempfile.TemporaryDirectory() as tmp:
        job_dir, node_dir = f"{tmp}/job", f"{tmp}/node"
        trace = Path(tmp) / "trace"
        command = ["strace", "-f", "-qq", "-e", "trace=%file", "-o", str(trace), sys.executable,
                   __file__, "--worker", "--module", str(module), "--phase", phase,
                   "--job-dir", job_dir, "--ranks", str(ranks), "--per-node",
                   str(args.per_node), "--beat", str(beat),
                   "--seconds", str(args.seconds)]  # fmt: skip
        started = time.monotonic()
        env = {"AXONN_NODE_DIR": node_dir, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
        subprocess.run(command, check=True, env=env)
        wall = time.monotonic() - started
        found = count(trace, job_dir, node_dir)
    return {"version": version, "phase": phase, "ranks": ranks, "beat_s": beat,
            "wall_s": round(wall, 1), **found}  # fmt: skip


def per_rank_minute(row: dict, args: argparse.Namespace, key: str) -> float:
    """A steady phase's count per rank per minute at the job's beat (2 s)."""
    beats = args.seconds / args.beat
    return row[key] / args.ranks / beats * (60 / JOB_BEAT_S)


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "# The watchdog's load on the shared file system: before and after its fixes",
        "",
        f"Watchdogs as threads of one process, {args.per_node} per node: steady state"
        f" {args.ranks} ranks, beat {args.beat} s, {args.seconds} s; hang {args.hang_ranks} ranks"
        f" and one silent, beat {args.hang_beat} s, every rank firing at once. Shared = under"
        " the job dir, node = the node-local folder; versions: "
        + ", ".join(f"`{rev}` ({BEFORE_WORDS.get(rev, 'a revision')})" for rev in args.before)
        + ", after = the working tree. Counted, not timed"
        " (`strace -f -e trace=%file`); ranks touching = threads with a shared call.",
        "",
        "| version | phase | ranks | shared ops | stat / read / write | ranks touching |"
        " node-local ops | heartbeat reads (ranks reading) |"
        " shared ops per rank per minute at beat_s 2 |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        rate = f"{per_rank_minute(row, args, 'shared'):.2f}" if row["phase"] == "steady" else "-"
        lines.append(
            f"| {row['version']} | {row['phase']} | {row['ranks']} | {row['shared']:,} |"
            f" {row['shared_stat']:,} / {row['shared_read']:,} / {row['shared_write']:,} |"
            f" {row['ranks_touching']} | {row['node']:,} |"
            f" {row['heartbeat_reads']:,} ({row['heartbeat_readers']}) | {rate} |"
        )
    lines += [
        "",
        "Steady state: before, every rank `stat`s `logs/heartbeats/REQUEST` at every beat;"
        " after, one rank per node does (the node's relay), the others look at a node-local"
        " copy: no file on the shared file system is touched by every rank. In a hang,"
        " before the collector every firing rank read every heartbeat at least once"
        " (O(ranks²) reads); after, the first firing rank to claim the collection reads"
        " them and the others read its one verdict file once a beat (O(ranks)). strace"
        " slows the threads, so the hang rows hold fewer polls than a real hang at"
        " beat_s 2 would.",
    ]
    return "\n".join(lines) + "\n"


def shown_module(rev: str, folder: Path) -> Path:
    """The watchdog module at git revision ``rev``, as a file in ``folder``."""
    path = folder / f"watchdog_{re.sub(r'[^0-9A-Za-z]', '_', rev)}.py"
    shown = subprocess.run(["git", "show", f"{rev}:{MODULE}"], cwd=REPO,
                           capture_output=True, text=True, check=True)  # fmt: skip
    path.write_text(shown.stdout)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--beat", type=float, default=0.2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--hang-ranks", type=int, default=32)
    parser.add_argument("--hang-beat", type=float, default=1.0, help="a window of 3 beats + 1 s")
    parser.add_argument("--before", nargs="+", default=list(BEFORE_WORDS),
                        help="git revisions of older watchdogs")  # fmt: skip
    parser.add_argument("--out", type=Path, default=HERE / "results" / "bench_watchdog_fs.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--module", help=argparse.SUPPRESS)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--job-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        versions = [(rev, shown_module(rev, Path(tmp))) for rev in args.before]
        versions.append(("after", REPO / MODULE))
        rows = [run_phase(v, m, p, args) for p in ("steady", "hang") for v, m in versions]
    text = table(rows, args)
    args.out.write_text(text)
    (args.out.with_suffix(".json")).write_text(json.dumps(rows, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
