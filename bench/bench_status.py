"""How long ``python -m axonn_launch.jobs status`` takes to scan many job records.

Writes N synthetic job directories (default 10,000) shaped like real ones: job.json,
metrics.jsonl, submitit's per-task result pickles and logs under slurm/<id>/. The mix:
70% completed, 10% failed with a CUDA OOM traceback, 10% killed by a signal, 10% queued.
Two scheduler situations are timed, each with a fake sacct/squeue on PATH:

- ``sacct``: one sacct call answers for every job (the normal case)
- ``no accounting``: sacct fails, squeue lists the queued jobs, every other job is
  classified from its result pickles and log tails (the slow path)

    python bench/bench_status.py [--jobs 10000] [--out bench/results/bench_status.md]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from axonn_launch.records import status

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
KILLED = "srun: error: n3: task 1: Killed\nsrun: error: n4: tasks 2-3: Killed\n"
KINDS = ["completed"] * 7 + ["oom", "killed", "queued"]


def write_job(root: Path, index: int, kind: str) -> tuple[str, str]:
    job_id = str(100_000 + index)
    job_dir = root / f"sweep{index // 1000}" / f"{index % 1000}-gpt_tiny"
    folder = job_dir / "slurm" / job_id
    folder.mkdir(parents=True)
    record = {
        "name": "gpt_tiny-perlmutter",
        "job_dir": str(job_dir),
        "job_ids": [job_id],
        "machine": "perlmutter",
        "scheduler": "slurm",
        "model": "gpt_tiny",
        "grid": {"data": 2, "x": 2, "y": 1, "z": 2},
        "nodes": 2,
        "tasks_per_node": 4,
        "steps": 200,
        "attempt": 1,
        "lineage": [],
        "command_line": ["axonn_launch", "machine=perlmutter", "grid.x=2", "grid.z=2"],
        "status": "submitted",
    }
    (job_dir / "job.json").write_text(json.dumps(record, indent=2))
    steps = 200 if kind == "completed" else (0 if kind == "queued" else 57)
    rows = (json.dumps({"step": s, "loss": 5.0 / s, "lr": 1e-3}) for s in range(1, steps + 1))
    (job_dir / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))
    if kind == "completed":  # rank 0 writes it after the last step
        summary = {"steps": 200, "final_loss": 0.025, "tokens_per_s": 9000.0, "step_time_s": 0.1}
        (job_dir / "summary.json").write_text(json.dumps(summary))
    if kind == "queued":
        return job_id, "PENDING|0:0|None assigned"
    for task in range(8):
        outcome = ("error", f"Traceback ...\n{OOM}\n") if kind == "oom" and task == 1 else None
        if kind == "completed":
            outcome = ("success", {"final_loss": 0.025})
        if outcome:
            with open(folder / f"{job_id}_{task}_result.pkl", "wb") as handle:
                pickle.dump(outcome, handle)
        log = (KILLED if kind == "killed" and task == 0 else "") + "step 57 loss 0.08\n" * 40
        (folder / f"{job_id}_{task}_log.out").write_text(log)
        (folder / f"{job_id}_{task}_log.err").write_text(OOM if kind == "oom" and task == 1 else "")
    state = {"completed": "COMPLETED|0:0", "oom": "FAILED|1:0", "killed": "FAILED|0:9"}[kind]
    return job_id, f"{state}|nid[001000-001001]"


def fake_tools(bindir: Path, states: dict[str, str], accounting: bool) -> None:
    bindir.mkdir(exist_ok=True)
    table = bindir / "sacct.txt"
    table.write_text("".join(f"{j}|{s}\n" for j, s in states.items()))
    queued = bindir / "squeue.txt"
    queued.write_text("".join(f"{j}|PENDING|\n" for j, s in states.items() if "PENDING" in s))
    sacct = f"cat {table}" if accounting else "echo 'accounting disabled' >&2; exit 1"
    for tool, body in (("sacct", sacct), ("squeue", f"cat {queued}")):
        (bindir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bindir / tool).chmod(0o755)


def time_scan(root: Path, repeats: int = 3) -> tuple[float, float, Counter]:
    """Best wall-clock and CPU seconds (this process and its sacct/squeue) of a scan."""
    best_wall = best_cpu = float("inf")
    classes: Counter = Counter()
    for _ in range(repeats):
        before, start = os.times(), time.perf_counter()
        rows = status.collect([str(root)])
        wall, after = time.perf_counter() - start, os.times()
        cpu = sum(after[:4]) - sum(before[:4])
        best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
        classes = Counter(r.failure for r in rows)
    return best_wall, best_cpu, classes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/bench_status.md"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_status_"))
    try:
        rng = random.Random(0)
        root = work / "jobs"
        states = dict(write_job(root, i, rng.choice(KINDS)) for i in range(args.jobs))
        results = []
        for label, accounting in (("sacct", True), ("no accounting", False)):
            bindir = work / f"bin-{accounting}"
            fake_tools(bindir, states, accounting)
            os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ['PATH']}"
            wall, cpu, classes = time_scan(root)
            results.append((label, wall, cpu, classes))
            print(
                f"{label:14s} {args.jobs} jobs: {wall:.2f} s wall, {cpu:.2f} s CPU  {dict(classes)}"
            )
        write_report(args.out, args.jobs, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_report(path: Path, n: int, results: list[tuple[str, float, float, Counter]]) -> None:
    lines = [
        "# `jobs status`: scanning job records",
        "",
        "Command: `python bench/bench_status.py --jobs "
        f"{n}` (best of 3 scans; files in the page cache).",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs,"
        f" Python {platform.python_version()}; load average {os.getloadavg()[0]:.1f} at the end.",
        "CPU seconds count this process and the sacct/squeue it runs: on a loaded machine",
        "wall-clock time is CPU time plus waiting for a core.",
        "",
        "| scheduler view | jobs | wall s | CPU s | classes found |",
        "|---|---|---|---|---|",
    ]
    for label, wall, cpu, classes in results:
        found = ", ".join(f"{k} {v}" for k, v in sorted(classes.items()))
        lines.append(f"| {label} | {n} | {wall:.2f} | {cpu:.2f} | {found} |")
    lines += [
        "",
        "Each job has 8 tasks; completed jobs have 8 result pickles and rank 0's summary.json.",
        "With sacct, completed jobs need job.json, summary.json and the end of metrics.jsonl",
        "(a COMPLETED job without summary.json also has its result pickles read: a killed",
        "slurmstepd ends the job COMPLETED with tasks missing), queued ones job.json and",
        "metrics.jsonl; failed ones also read",
        "their result pickles and the last 16 KiB of task 0's logs (all tasks' logs only for",
        "a collective failure or an unknown cause). Without accounting every ended job is",
        "read that way, including the 8 result pickles of each completed job.",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
