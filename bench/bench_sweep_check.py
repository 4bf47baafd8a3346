"""A dry-run sweep of N points (``-m machine=slurm_local train.seed=1,...,N dry_run=true``):
the checked-out code against a git revision's (``--before REV``, unpacked with
``git archive`` into a temporary dir and put first on PYTHONPATH), in interleaved runs.
Reports the median and IQR of wall seconds and of peak memory, and the load average.

    python bench/bench_sweep_check.py --points 500 --pairs 10 --before HEAD

``--before-path DIR`` takes the 'before' arm from a directory holding an ``axonn_launch``
package instead (e.g. uncommitted work copied aside).
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


def run_sweep(points: int, pythonpath: str, folder: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one dry-run sweep."""
    seeds = ",".join(str(s) for s in range(1, points + 1))
    command = [sys.executable, "-m", "axonn_launch", "-m", "machine=slurm_local",
               f"train.seed={seeds}", "dry_run=true", f"hydra.sweep.dir={folder}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run(command, cwd=folder.parent, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"sweep failed: {done.stderr[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) / 1024


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):.1f} (IQR {q[0]:.1f}-{q[2]:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", type=int, default=500)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--before", default="", help="git revision of the 'before' arm")
    parser.add_argument("--before-path", default="", help="or a dir holding its axonn_launch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"after (this checkout)": str(ROOT)}
        if args.before:
            old = Path(tmp) / "before"
            old.mkdir()
            archive = subprocess.run(["git", "archive", args.before, "axonn_launch"], cwd=ROOT,
                                     capture_output=True, check=True).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            arms = {f"before ({args.before})": str(old), **arms}
        elif args.before_path:
            arms = {f"before ({args.before_path})": args.before_path, **arms}
        walls: dict[str, list[float]] = {arm: [] for arm in arms}
        peaks: dict[str, float] = {}
        loads = []
        for pair in range(args.pairs):
            for arm, path in arms.items():
                loads.append(os.getloadavg()[0])
                wall, peak = run_sweep(args.points, path, Path(tmp) / f"s{pair}-{len(walls[arm])}")
                walls[arm].append(wall)
                peaks[arm] = peak  # the children's largest so far (ru_maxrss)
                print(f"{arm}: {wall:.1f} s", file=sys.stderr, flush=True)
    print(
        f"{args.points}-point dry-run sweep, {args.pairs} interleaved run(s) per arm;"
        f" 1-min load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores"
    )
    print("| arm | wall s, median (IQR) | peak RSS of any run so far, MB |\n|---|---|---|")
    for arm, values in walls.items():
        print(f"| {arm} | {spread(values)} | {peaks[arm]:.0f} |")


if __name__ == "__main__":
    main()
