"""The default local job's wall time and memory, with and without the warm start, against
``python -c "import torch"``.

Three commands run in turn, round after round, so machine noise hits them alike:

- ``python -c "import torch"``;
- the default job, ``python -m axonn_launch train.steps=5 train.sample_tokens=0`` (4 ranks,
  x=2 z=2), with the warm start (ranks forked from one process that imported the job side,
  ``train/zygote.py``, the default; its supervisor, and with it those imports, start
  before the launcher composes the job: ``scheduler/processes.py``'s ``start_early_supervisor``);
- the same job with ``AXONN_RANK_START=exec``: every rank starts Python afresh. This is
  today's code with the old way of starting ranks: a proxy for "before", labelled so;
- the same job at the commit before the warm start (``--before-commit``, default 7d72489,
  the parent of f13b2b3 which brought the warm start), checked out with ``git worktree
  add`` into a temporary folder and run with that folder first on ``PYTHONPATH`` (same
  virtual environment); the worktree is removed at the end.

Memory: in a separate round of each job, a sampler reads ``/proc/<pid>/smaps_rollup`` of
the job's rank processes (and the zygote) every 0.1 s; the peak of the sum of their PSS
(proportional set size: a page shared by N processes counts 1/N to each) is reported.
Target: the warm job's median at most 2.5x that of ``import torch``.

    python bench/bench_warm_start.py [--repeats 5] [--before-commit 7d72489]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "bench_warm_start.md"
REPO = Path(__file__).resolve().parents[1]
JOB = ["-m", "axonn_launch", "train.steps=5", "train.sample_tokens=0"]
BEFORE_COMMIT = "7d72489"  # the parent of f13b2b3, the warm start's first commit
MODES = {
    "warm start (fork)": "fork",
    "proxy for before: today's code, a fresh Python per rank (exec)": "exec",
    "before: the commit before the warm start": "before",
}


def timed(cmd: list[str], cwd: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def job_env(mode: str, before_src: str = "") -> dict[str, str]:
    """The job's environment; ``before`` runs the package from the old commit's worktree."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PYTHONPATH")}
    if mode == "before":
        return {**env, "PYTHONPATH": before_src}
    return {**env, "AXONN_RANK_START": mode}


@contextlib.contextmanager
def worktree(commit: str) -> Iterator[str]:
    """A detached ``git worktree`` of ``commit`` in a temporary folder, removed after."""
    with tempfile.TemporaryDirectory() as tmp:
        src = str(Path(tmp) / "src")
        git = ["git", "-C", str(REPO), "worktree"]
        subprocess.run([*git, "add", "--detach", src, commit], check=True, capture_output=True)
        try:
            where = subprocess.run(
                [sys.executable, "-c", "import axonn_launch; print(axonn_launch.__file__)"],
                env=job_env("before", src), check=True, capture_output=True, text=True, cwd=tmp,
            ).stdout  # fmt: skip
            if not where.startswith(src):
                raise SystemExit(f"the old commit's package was not the one imported: {where}")
            yield src
        finally:
            subprocess.run([*git, "remove", "--force", src], check=False, capture_output=True)


def job_processes(job_dir: str) -> dict[str, list[int]]:
    """``ranks`` and ``zygote`` pids of the job in ``job_dir``, from /proc."""
    found: dict[str, list[int]] = {"ranks": [], "zygote": []}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if job_dir not in argv:
            continue
        if comm.startswith("axonn-rank-") or "axonn_launch.train" in argv:
            found["ranks"].append(int(entry.name))
        elif comm == "axonn-zygote":
            found["zygote"].append(int(entry.name))
    return found


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_pss(cmd: list[str], cwd: str, env: dict[str, str], job_dir: str) -> dict[str, float]:
    """Peak sum of PSS (MiB) of the ranks, and of the ranks with the zygote, over one run."""
    peaks = {"ranks": 0, "ranks + zygote": 0, "rank count": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            procs = job_processes(job_dir)
            ranks = sum(pss_kib(p) for p in procs["ranks"])
            zygote = sum(pss_kib(p) for p in procs["zygote"])
            peaks["ranks"] = max(peaks["ranks"], ranks)
            peaks["ranks + zygote"] = max(peaks["ranks + zygote"], ranks + zygote)
            peaks["rank count"] = max(peaks["rank count"], len(procs["ranks"]))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True)
    finally:
        done.set()
        sampler.join()
    return {k: (v / 1024 if k != "rank count" else v) for k, v in peaks.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before-commit", default=BEFORE_COMMIT)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with worktree(args.before_commit) as src:
        times, memory = measure(args.repeats, src)
    text = report(times, memory, args.repeats, args.before_commit, load_before)
    RESULTS.write_text(text)
    print(RESULTS.read_text())


def measure(repeats: int, before_src: str) -> tuple[dict[str, list[float]], dict[str, dict]]:
    torch_cmd = [sys.executable, "-c", "import torch"]
    times: dict[str, list[float]] = {"torch": [], **{m: [] for m in MODES}}
    memory: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        job = [sys.executable, *JOB]
        for value in MODES.values():  # warm the file cache
            env = job_env(value, before_src)
            timed([*job, f"hydra.run.dir={tmp}/warmup-{value}"], tmp, env)
        for round_ in range(repeats):
            times["torch"].append(timed(torch_cmd, tmp, job_env("fork")))
            for mode, value in MODES.items():
                run_dir = f"hydra.run.dir={tmp}/{value}-{round_}"
                times[mode].append(timed([*job, run_dir], tmp, job_env(value, before_src)))
            print(f"round {round_ + 1}/{repeats}", {k: round(v[-1], 2) for k, v in times.items()})
        for mode, value in MODES.items():
            job_dir = f"{tmp}/memory-{value}"
            env = job_env(value, before_src)
            memory[mode] = peak_pss([*job, f"hydra.run.dir={job_dir}"], tmp, env, job_dir)
    return times, memory


def report(
    times: dict[str, list[float]],
    memory: dict[str, dict],
    repeats: int,
    commit: str,
    load_before: tuple[float, ...],
) -> str:
    torch_s = statistics.median(times["torch"])
    load = " before, ".join("/".join(f"{v:.1f}" for v in x) for x in (load_before, os.getloadavg()))
    rows = [
        "## Local job start-up: the warm start",
        "",
        f"Script: bench/bench_warm_start.py (`python bench/bench_warm_start.py --repeats "
        f"{repeats} --before-commit {commit}`)",
        "",
        f"Medians of {repeats} rounds that run the four commands in turn; wall clock; the job "
        f"is `python {' '.join(JOB)}`, 4 ranks. 'before' is the code of commit {commit} "
        "(the parent of the warm start's first commit, f13b2b3), from a `git worktree` of it "
        "in the same virtual environment; the proxy row is today's code with "
        f"`AXONN_RANK_START=exec`. Load average (1/5/15 min): {load} after.",
        "",
        "| command | median s | min s | max s | x import torch |",
        "|---|---|---|---|---|",
        f'| `python -c "import torch"` | {torch_s:.2f} | {min(times["torch"]):.2f} | '
        f"{max(times['torch']):.2f} | 1.00 |",
    ]
    for mode in MODES:
        t = statistics.median(times[mode])
        rows.append(
            f"| default job, {mode} | {t:.2f} | {min(times[mode]):.2f} | "
            f"{max(times[mode]):.2f} | {t / torch_s:.2f} |"
        )
    warm, proxy, cold = (statistics.median(times[m]) for m in MODES)
    rows += [
        "",
        f"Warm start / import torch: **{warm / torch_s:.2f}** (target <= 2.5); "
        f"before ({commit}) / import torch: {cold / torch_s:.2f}; warm / before: "
        f"{warm / cold:.2f}; the proxy / import torch: {proxy / torch_s:.2f}.",
        "",
        "Peak memory of the job's processes, sum of PSS (one run each, sampled every 0.1 s):",
        "",
        "| ranks started | ranks, MiB | ranks + zygote, MiB |",
        "|---|---|---|",
    ]
    for mode in MODES:
        m = memory[mode]
        rows.append(
            f"| {mode} ({m['rank count']:.0f} ranks seen) | {m['ranks']:.0f} | "
            f"{m['ranks + zygote']:.0f} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
