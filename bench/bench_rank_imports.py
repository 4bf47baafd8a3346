"""A rank's CPU from its start to its exit, with the job side imported with the collector
on (before) and off then frozen (after: ``import_frozen`` in ``axonn_launch/train/zygote.py``).

Two measures, each in interleaved pairs (``pairs.py``: the arms alternate which goes first):

- **Slurm task:** the same 4-task job (2 nodes, x=2 z=2, gpt_tiny, 2 steps, no preflight,
  no recovery job) on the local cluster, submitted once from this checkout ("after") and
  once from a ``git worktree`` of ``--before-commit`` put first on ``PYTHONPATH`` (same
  virtual environment; the job runs the code snapshot of the tree it was launched from).
  The figure is ``sacct``'s TotalCPU of the job's step divided by its task count: all of
  a task's CPU, its imports, rendezvous, two steps, a checkpoint and its exit.
- **Fresh process:** ``python -c`` that imports ``RANK_IMPORTS`` and exits, plainly
  ("before") or through ``import_frozen`` ("after"); the child's user+system CPU (wait4).

Needs the local cluster (``machines/slurm_local/start.sh``) for the first measure.

    .venv/bin/python bench/bench_rank_imports.py [--pairs 10] [--before-commit 8efaf61]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pairs as paired  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "bench_rank_imports.md"
BEFORE_COMMIT = "8efaf61"  # the parent of the commit that brought import_frozen
JOB = [
    "machine=slurm_local", "grid.x=2", "grid.z=2", "nodes=2", "train.steps=2",
    "train.sample_tokens=0", "train.gemm_tuning=false", "preflight=false", "recovery=off",
    "force=true",
]  # fmt: skip
PLAIN = (
    "import importlib; from axonn_launch.train.zygote import RANK_IMPORTS; "
    "[importlib.import_module(m) for m in RANK_IMPORTS]"
)
FROZEN = (
    "from axonn_launch.train.zygote import RANK_IMPORTS, import_frozen; import_frozen(RANK_IMPORTS)"
)


@contextlib.contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """A checkout of ``commit`` in a temporary folder, removed at the end."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path),
                        commit], check=True, capture_output=True)  # fmt: skip
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(path)], check=False, capture_output=True)  # fmt: skip


def sacct_step(job_id: str) -> tuple[str, float, int]:
    """(state, TotalCPU seconds, tasks) of the job's step 0."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-j", f"{job_id}.0", "-o", "State,TotalCPU,NTasks"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    if not out:
        return "", 0.0, 0
    state, cpu, tasks = out.splitlines()[0].split("|")
    return state, cpu_seconds(cpu), int(tasks or 0)


def cpu_seconds(text: str) -> float:
    """sacct's ``[DD-][HH:]MM:SS[.mmm]`` in seconds."""
    days, _, rest = text.rpartition("-")
    parts = [float(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0.0)
    return int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def slurm_task_cpu(tree: Path | None, root: Path, index: int) -> float:
    """CPU seconds per task of one job launched from ``tree`` (None: this checkout)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    job_dir = root / f"{'before' if tree else 'after'}{index}"
    out = subprocess.run(
        [sys.executable, "-m", "axonn_launch", *JOB, f"hydra.run.dir={job_dir}"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    job_id = out.split("submitted job ", 1)[1].split()[0]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        state, cpu, tasks = sacct_step(job_id)
        if state == "COMPLETED" and tasks:
            return cpu / tasks
        if state and state not in ("RUNNING", "PENDING", "COMPLETING"):
            raise RuntimeError(f"job {job_id} step 0 ended {state}")
        time.sleep(1)
    raise RuntimeError(f"job {job_id} did not complete in 300 s")


def fresh_process_cpu(code: str) -> float:
    """User+system CPU seconds of ``python -c code`` from its start to its exit."""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"python -c {code!r} exited {proc.returncode}")
    return usage.ru_utime + usage.ru_stime


def section(title: str, pairs: list[dict[str, float]], unit: str) -> list[str]:
    saved = [p["off"] - p["on"] for p in pairs]
    q1, med, q3 = paired.quartiles(saved)
    before = paired.quartiles([p["off"] for p in pairs])[1]
    after = paired.quartiles([p["on"] for p in pairs])[1]
    return [
        f"### {title}", "",
        f"Median {unit}: before {before:.2f} s, after {after:.2f} s. Saved per pair (before "
        f"- after): median {med:.2f} s, IQR {q1:.2f} to {q3:.2f} s; after/before - 1: "
        f"{paired.verdict(paired.ratios(pairs))}.", "",
        *paired.pair_table(pairs, unit=unit, digits=2).__iter__(), "",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=paired.MIN_PAIRS)
    parser.add_argument("--before-commit", default=BEFORE_COMMIT)
    args = parser.parse_args(argv)
    load_before = paired.load_now()
    fresh = paired.interleaved(
        lambda i: fresh_process_cpu(FROZEN), lambda i: fresh_process_cpu(PLAIN), args.pairs
    )
    with worktree(args.before_commit) as tree, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        slurm = paired.interleaved(
            lambda i: slurm_task_cpu(None, root, i),
            lambda i: slurm_task_cpu(tree, root, i),
            args.pairs,
        )
    load_after = paired.load_now()
    lines = [
        "## A rank's imports: the collector off, then frozen", "",
        f"Script: bench/bench_rank_imports.py (`.venv/bin/python bench/bench_rank_imports.py "
        f"--pairs {args.pairs} --before-commit {args.before_commit}`)", "",
        f"{paired.load_line(load_before, load_after)}; {os.cpu_count()} cores. In the "
        "tables, on = after (collector off while importing, then frozen), off = before "
        f"(commit {args.before_commit} for the Slurm task; a plain import for the fresh "
        "process).", "",
        *section("Slurm task: sacct TotalCPU of step 0 per task", slurm, "CPU s per task"),
        *section("Fresh process: import RANK_IMPORTS and exit", fresh, "CPU s"),
    ]  # fmt: skip
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
