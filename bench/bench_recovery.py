"""Reliability on the local Slurm cluster: a soak of self-recovering runs with faults from a
seeded schedule, no command typed after the launches.

Five runs (gpt_tiny, x=2 on one node, 12 steps, a checkpoint every 2) each get three faults,
one per attempt at a later step each time: a rank killed with SIGKILL or a collective
failure (``AXONN_FAULT=KIND@stepN:rankR:attemptA``), or, at most once per run, its node
taken down (``scontrol update state=down``) while the attempt is paused after step N. A
node down ends every task on that node, so other runs fail with it too (unplanned node
failures, healed like the rest); the node returns to service by itself
(``ReturnToService=2``) and a later attempt may use it again. The collective failures
resume in place (``recovery.policy.collective_failure=resume``); the limits are raised
(``max_attempts=8``) so that the unplanned failures cannot stop a run. A reference run of
the same job without faults gives the loss every run must end at.

Reported, per run and in all, from the launcher's own accounting (``records/goodput.py``,
as ``jobs status`` shows it): goodput (useful step time over allocated time, sacct Start
to End of every attempt) and where the rest went; the median time to recovery (from the
failed attempt's end to the next attempt's first step); runs lost and final losses that
differ.

    python bench/bench_recovery.py [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from axonn_launch.common.jobdir import JobPaths, read_record, read_record_or_empty  # noqa: E402
from axonn_launch.records.goodput import PARTS  # noqa: E402
from axonn_launch.records.runs import runs  # noqa: E402
from axonn_launch.records.status import collect  # noqa: E402
from axonn_launch.submit.chain import DONE, STOPPED, attempts_of, run_state  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_recovery.md"
STEPS, EVERY, RUNS, FAULTS = 12, 2, 5, 3
BASE = ["machine=slurm_local", "grid.x=2", "nodes=1", f"train.steps={STEPS}",
        f"train.checkpoint_every={EVERY}", "train.sample_tokens=0", "preflight=false",
        "recovery.backoff_s=1", "recovery.policy.collective_failure=resume",
        "recovery.max_attempts=8",
        f"recovery.max_same_class={FAULTS + 3}",  # the soak's faults may repeat a class
        # the chain is measured here: a fault pinned to an attempt would fire again in
        # place (a restart in place is the same attempt); bench/bench_in_place.py compares
        "recovery.in_job_restarts=0",
        "wait=false"]  # fmt: skip
NODE_DOWN = "nodedown"


def schedule(rng: random.Random) -> list[tuple[str, int, int, int]]:
    """Three faults (kind, step, rank, attempt), one per attempt, each after the previous
    one's checkpoint; at most one node down."""
    faults, step = [], 2
    for attempt in range(1, FAULTS + 1):
        step = rng.randint(step + 1, step + 3)
        kinds = ["kill", "collective"] + (
            [] if any(f[0] == NODE_DOWN for f in faults) else [NODE_DOWN]
        )
        faults.append((rng.choice(kinds), step, rng.randint(0, 1), attempt))
    return faults


def fault_text(faults: list[tuple[str, int, int, int]]) -> str:
    """AXONN_FAULT: a node down is a pause on every rank, during which the node goes down."""
    return ",".join(
        f"pause@step{step}:600:attempt{attempt}" if kind == NODE_DOWN
        else f"{kind}@step{step}:rank{rank}:attempt{attempt}"
        for kind, step, rank, attempt in faults
    )  # fmt: skip


def launch(root: Path, name: str, fault: str, extra: list[str]) -> Path:
    job_dir = root / name
    env = {**os.environ, "AXONN_FAULT": fault}
    subprocess.run([sys.executable, "-m", "axonn_launch", *BASE, *extra,
                    f"hydra.run.dir={job_dir}"], cwd=root, env=env, check=True,
                   capture_output=True)  # fmt: skip
    return job_dir


def take_paused_nodes_down(roots: dict[str, Path], done: set[str]) -> None:
    """Take down the node of each attempt paused by the schedule (once per attempt)."""
    for root in roots.values():
        attempt = attempts_of(root)[-1]
        record = read_record_or_empty(attempt)  # a new attempt's may not be written yet
        job_id = str((record.get("job_ids") or [""])[-1])
        if not job_id or job_id in done:
            continue
        log = attempt / "slurm" / job_id / f"{job_id}_0_log.out"
        if log.exists() and "injecting pause after step" in log.read_text(errors="replace"):
            node = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True,
                                  text=True).stdout.strip()  # fmt: skip
            if node:
                subprocess.run(["scontrol", "update", f"nodename={node}", "state=down",
                                "reason=bench_recovery"], check=True)  # fmt: skip
                print(f"took {node} down under job {job_id} ({root.name})", flush=True)
            done.add(job_id)


def measure(root: Path) -> dict:
    attempts = attempts_of(root)
    (row,) = runs(collect([str(a) for a in attempts]))
    history = (read_record(root).get("chain") or {}).get("attempts") or []
    done = run_state(root) == DONE
    loss = json.loads(JobPaths(attempts[-1]).summary.read_text())["final_loss"] if done else None
    return {"attempts": len(attempts), "goodput": row.goodput, "loss": loss,
            "state": run_state(root), "classes": [a["class"] for a in history]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    plan = {f"run{i}": schedule(rng) for i in range(RUNS)}
    started = time.time()
    tmp = tempfile.mkdtemp(dir=os.environ.get("TMPDIR", "/tmp"))  # kept if the soak fails
    root = Path(tmp)
    print(f"runs in {root}", flush=True)
    reference = launch(root, "reference", "", ["recovery=off"])
    roots = {name: launch(root, name, fault_text(f), []) for name, f in plan.items()}
    deadline, downed = time.time() + 3600, set()
    try:
        while any(run_state(r) not in (DONE, STOPPED) for r in roots.values()):
            assert time.time() < deadline, "the soak did not end within an hour"
            take_paused_nodes_down(roots, downed)
            time.sleep(3)
    finally:
        for node in ("n1", "n2"):
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"],
                           capture_output=True)  # fmt: skip
    while not JobPaths(reference).summary.exists():
        time.sleep(2)
    while subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip():
        time.sleep(2)  # every attempt's end in sacct: goodput needs it
    expected = json.loads(JobPaths(reference).summary.read_text())["final_loss"]
    results = {name: measure(r) for name, r in roots.items()}
    write_results(args.seed, plan, results, expected, time.time() - started)
    shutil.rmtree(tmp, ignore_errors=True)


def write_results(seed: int, plan: dict, results: dict, expected: float, wall_s: float) -> None:
    ttr = [t for r in results.values() for t in r["goodput"].get("ttr_s", [])]
    lost = sum(r["state"] != DONE for r in results.values())
    differ = sum(r["loss"] != expected for r in results.values())
    total = {part: sum(r["goodput"].get(f"{part}_s", 0.0) for r in results.values())
             for part in ("allocated", *PARTS)}  # fmt: skip
    lines = [
        "## Recovery soak on the local Slurm cluster",
        "",
        f"Command: `python bench/bench_recovery.py --seed {seed}` ({RUNS} runs, "
        f"{sum(r['attempts'] for r in results.values())} attempts, {wall_s / 60:.0f} min; "
        "faults from the seeded schedule below, node downs included; gpt_tiny x=2 on one "
        "node, 12 steps, a checkpoint every 2)",
        "",
        "| run | scheduled faults | failures healed (class) | attempts | goodput | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        loss = f"{r['loss']:.6f}" if r["loss"] is not None else f"none ({r['state']})"
        faults = ", ".join(f"{k}@{s}" + (f":rank{q}" if k != NODE_DOWN else "") + f" (a{a})"
                           for k, s, q, a in plan[name])  # fmt: skip
        good = r["goodput"].get("goodput")
        lines.append(f"| {name} | {faults} | {', '.join(r['classes'])} | {r['attempts']} "
                     f"| {good:.1%} | {loss} |" if good is not None else
                     f"| {name} | {faults} | {', '.join(r['classes'])} | {r['attempts']} "
                     f"| - | {loss} |")  # fmt: skip
    allocated = total["allocated"] or 1.0
    shares = ", ".join(f"{part} {total[part] / allocated:.1%}" for part in PARTS)
    lines += [
        "",
        f"All runs: goodput **{total['useful'] / allocated:.1%}** of "
        f"{allocated / 60:.1f} min allocated ({shares}; the parts sum to "
        f"{sum(total[p] for p in PARTS) / allocated:.1%} of it).",
        "",
        f"Median time to recovery (failed attempt's end to the next attempt's first step): "
        f"**{statistics.median(ttr):.1f} s** (min {min(ttr):.1f}, max {max(ttr):.1f}, "
        f"{len(ttr)} recoveries). Runs lost: **{lost}**. Final losses that differ from the "
        f"uninterrupted run's ({expected:.6f}): **{differ}**.",
        "",
        "Goodput here is low by design: a 12-step run with 3 faults spends much of its "
        "allocation starting up, and the five runs share the two local nodes' CPUs, so every "
        "time above is longer than on an idle cluster.",
        "",
    ]
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
