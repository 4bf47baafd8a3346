"""A dry-run sweep of N points (``-m machine=slurm_local train.seed=1,...,N dry_run=true``):
the checked-out code against a git revision's (``--before REV``, unpacked with
``git archive`` into a temporary dir and put first on PYTHONPATH), in interleaved runs.
Reports the median and IQR of wall seconds and of peak memory, and the load average.

    python bench/bench_sweep_check.py --points 500 --pairs 10 --before HEAD

``--before-path DIR`` takes the 'before' arm from a directory holding an ``axonn_launch``
package instead (e.g. uncommitted work copied aside). ``--after REV`` takes the 'after' arm
from a revision too (a checkout that others edit meanwhile stays out of the measurement).
With a 'before' arm, each pair's after/before ratio of wall seconds is reported too; the
order of the two arms alternates from pair to pair. ``--out FILE`` appends the tables.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_sweep(points: int, pythonpath: str, folder: Path) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + system) and peak RSS (MB) of one dry-run sweep: on
    a shared machine the CPU seconds move less with the load than the wall seconds."""
    seeds = ",".join(str(s) for s in range(1, points + 1))
    command = [sys.executable, "-m", "axonn_launch", "-m", "machine=slurm_local",
               f"train.seed={seeds}", "dry_run=true", f"hydra.sweep.dir={folder}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath}
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    before, cpu = used.ru_maxrss, used.ru_utime + used.ru_stime
    start = time.perf_counter()
    done = subprocess.run(command, cwd=folder.parent, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"sweep failed: {done.stderr[-2000:]}")
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, used.ru_utime + used.ru_stime - cpu, max(used.ru_maxrss, before) / 1024


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):.1f} (IQR {q[0]:.1f}-{q[2]:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", type=int, default=500)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--before", default="", help="git revision of the 'before' arm")
    parser.add_argument("--before-path", default="", help="or a dir holding its axonn_launch")
    parser.add_argument("--after", default="", help="git revision of the 'after' arm")
    parser.add_argument("--out", default="", help="append the tables to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"after (this checkout)": str(ROOT)}
        if args.after:
            arms = {f"after ({args.after})": unpacked(args.after, Path(tmp) / "after")}
        if args.before:
            arms = {f"before ({args.before})": unpacked(args.before, Path(tmp) / "before"), **arms}
        elif args.before_path:
            arms = {f"before ({args.before_path})": args.before_path, **arms}
        walls: dict[str, list[float]] = {arm: [] for arm in arms}
        cpus: dict[str, list[float]] = {arm: [] for arm in arms}
        peaks: dict[str, float] = {}
        loads = []
        for pair in range(args.pairs):
            order = list(arms.items()) if pair % 2 == 0 else list(arms.items())[::-1]
            for arm, path in order:
                loads.append(os.getloadavg()[0])
                folder = Path(tmp) / f"s{pair}-{len(walls[arm])}"
                wall, cpu, peak = run_sweep(args.points, path, folder)
                walls[arm].append(wall)
                cpus[arm].append(cpu)
                peaks[arm] = peak  # the children's largest so far (ru_maxrss)
                print(f"{arm}: {wall:.1f} s, CPU {cpu:.1f} s", file=sys.stderr, flush=True)
    text = report(args, walls, cpus, peaks, loads)
    print(text)
    if args.out:
        with open(args.out, "a") as out:
            out.write("\n" + text + "\n")


def unpacked(revision: str, folder: Path) -> str:
    """The package at git ``revision``, unpacked into ``folder`` (for PYTHONPATH)."""
    folder.mkdir()
    archive = subprocess.run(["git", "archive", revision, "axonn_launch"], cwd=ROOT,
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return str(folder)


def report(
    args: argparse.Namespace, walls: dict, cpus: dict, peaks: dict, loads: list[float]
) -> str:
    """The tables: each arm's wall and CPU seconds (median, IQR) and peak RSS; with two arms,
    each pair's after/before ratio of wall seconds and their median and IQR."""
    lines = [
        f"{args.points}-point dry-run sweep, {args.pairs} interleaved run(s) per arm, the order"
        f" alternating; 1-min load average {min(loads):.1f}-{max(loads):.1f} on"
        f" {os.cpu_count()} cores, {time.strftime('%Y-%m-%d', time.gmtime())}",
        "",
        "| arm | wall s, median (IQR) | CPU s, median (IQR) | wall s, each run |"
        " peak RSS of any run so far, MB |",
        "|---|---|---|---|---|",
    ]
    for arm, values in walls.items():
        each = ", ".join(f"{v:.1f}" for v in values)
        lines.append(
            f"| {arm} | {spread(values)} | {spread(cpus[arm])} | {each} | {peaks[arm]:.0f} |"
        )
    if len(walls) == 2:
        before, after = walls.values()
        ratios = [a / b for a, b in zip(after, before)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        lines += ["", f"after/before per pair: median {statistics.median(ratios):.2f}"
                  f" (IQR {q[0]:.2f}-{q[2]:.2f}); each: "
                  + ", ".join(f"{r:.2f}" for r in ratios)]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
