"""Every scale bench in one command, within a stated time budget.

    python bench/scale/all.py --budget-s 7200      # the stages below, then BENCHMARKS.md
    python bench/scale/all.py --budget-s 900 --only heal groups

The stages, in order (each writes its own results and BENCHMARKS.md section, every figure
labelled measured, emulated or extrapolated):

1. ``startup``: the Frontier script's start-up against N, with trivial tasks (``run.py``;
   also writes the package's start-up model, ``startup_model.py``);
2. ``emulated``: the same with the job's emulated ranks (``run.py --emulated``, given the
   budget left, which it divides among its node counts itself);
3. ``heal``: a node set DOWN mid-run, healed on a spare inside the job (``heal.py``);
4. ``dcp``: DCP's save plan and ``.metadata`` at 32,768 ranks (``dcp_plan.py``);
5. ``rank``: one real rank of each headline point (``rank_points.py``);
6. ``groups``: group creation at 32,768 ranks (``bench/bench_groups.py``).

Before each stage its time is predicted: its last run's wall time where its results say it,
else the estimate below (measured once on this host). A stage predicted to end past the
budget is left out, and the summary (bench/results/scale_all.json and .md) says which and
why; a stage that runs past the budget is stopped, with what it started (``stop_stage``).
Stages run one at a time: each is the only load on the host, as its figures assume. No
torch here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


@dataclass(frozen=True)
class Stage:
    name: str
    args: tuple[str, ...]  # after the interpreter
    results: str  # its JSON in bench/results, whose wall_s (if any) predicts its time
    estimate_s: float  # else this: measured once on this host (2 cores), stated


STAGES = (
    Stage(
        "startup",
        ("bench/scale/run.py", "--nodes", "8", "32", "128", "256", "512"),
        "scale.json",
        900.0,
    ),  # fmt: skip
    Stage(
        "emulated",
        ("bench/scale/run.py", "--emulated", "--nodes", "8", "32", "128", "256"),
        "scale_emulated.json",
        1200.0,
    ),  # fmt: skip
    Stage("heal", ("bench/scale/heal.py", "--nodes", "8", "32", "128"), "scale_heal.json", 600.0),
    Stage("dcp", ("bench/scale/dcp_plan.py",), "dcp_plan.json", 600.0),
    Stage("rank", ("bench/scale/rank_points.py",), "rank_rehearsal.json", 900.0),
    Stage("groups", ("bench/bench_groups.py", "--pairs", "10"), "bench_groups.json", 600.0),
)


def predicted_s(stage: Stage) -> float:
    """The stage's last wall time where its results record one, else its estimate."""
    path = RESULTS / stage.results
    try:
        found = json.loads(path.read_text()).get("wall_s")
    except (OSError, ValueError, AttributeError):
        found = None
    return float(found) if isinstance(found, int | float) else stage.estimate_s


def stage_args(stage: Stage, left_s: float) -> list[str]:
    """The stage's command; the emulated stage gets the budget left as its own."""
    args = [sys.executable, *stage.args]
    if stage.name == "emulated":
        args += ["--budget-s", f"{left_s:.0f}"]
    return args


GRACE_S = 300.0  # a stopped stage's own clean-up: the scale cluster's stop.sh takes ≤ 300 s


def run_stage(stage: Stage, left_s: float) -> dict:
    """One stage, stopped at ``left_s`` (``stop_stage``): its exit status and wall time. It
    runs in a session of its own, so that what it started can be found and ended."""
    began = time.monotonic()
    with subprocess.Popen(stage_args(stage, left_s), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=left_s)
            rc, tail = proc.returncode, output[-400:]
        except subprocess.TimeoutExpired:
            rc, tail = None, stop_stage(proc, left_s)
    return {"rc": rc, "wall_s": round(time.monotonic() - began, 1), "tail": tail}


def stop_stage(proc: subprocess.Popen, left_s: float) -> str:
    """SIGINT to the stage, as Ctrl-C would: its ``finally`` blocks stop the scale cluster
    it started. What is left of its session after ``GRACE_S`` is killed (SIGKILL): the
    stage's children, a job step's processes. Says which."""
    if proc.poll() is not None:
        how = "ended, but what it started held its output until the budget"
    else:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=GRACE_S)
            how = "stopped at the budget (SIGINT)"
        except subprocess.TimeoutExpired:
            how = f"killed at the budget (no end {GRACE_S:.0f} s after SIGINT)"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its session's group: whatever it left
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=10)  # its output's end, unless a daemon outside holds it
    return f"{how}; {left_s:.0f} s of the budget left when it began"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-s", type=float, required=True)
    parser.add_argument("--only", nargs="+", choices=[s.name for s in STAGES])
    parser.add_argument("--out", type=Path, default=RESULTS / "scale_all.json")
    args = parser.parse_args(argv)
    began, rows = time.monotonic(), []
    for stage in STAGES:
        if args.only and stage.name not in args.only:
            continue
        left = args.budget_s - (time.monotonic() - began)
        predicted = predicted_s(stage)
        row = {"stage": stage.name, "command": " ".join(["python", *stage.args]),
               "predicted_s": round(predicted, 1)}  # fmt: skip
        if stage.name != "emulated" and predicted > left:
            row["skipped"] = f"predicted {predicted:.0f} s, {max(left, 0):.0f} s of the budget left"
        elif left <= 0:
            row["skipped"] = "no budget left"
        else:
            row |= run_stage(stage, left)
        rows.append(row)
        print(json.dumps(row), flush=True)
    subprocess.run([sys.executable, "bench/make_benchmarks_md.py"], cwd=REPO, check=True)
    ran = shlex.join(["python", "bench/scale/all.py", *(sys.argv[1:] if argv is None else argv)])
    result = {"command": ran, "budget_s": args.budget_s, "only": args.only,
              "wall_s": round(time.monotonic() - began, 1), "when": time.strftime(
                  "%Y-%m-%d %H:%M UTC", time.gmtime()), "stages": rows}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    return 0 if all(r.get("rc") in (0, None) or "skipped" in r for r in rows) else 1


def markdown(result: dict) -> str:
    lines = [
        "# At scale: every bench in one command, within a time budget",
        "",
        f"Script: bench/scale/all.py (`{result['command']}`)",
        "",
        f"The last run: budget {result['budget_s']:,.0f} s"
        + (f", stages {', '.join(result['only'])}" if result["only"] else ", every stage")
        + f"; {result['wall_s']:,.0f} s used; {result['when']}. Each stage's figures are in"
        " its own section.",
        "",
        "| stage | command | predicted s | ran | exit status | wall s |",
        "|---|---|---:|---|---:|---:|",
    ]
    for r in result["stages"]:
        ran = "no: " + r["skipped"] if "skipped" in r else "yes"
        rc = "" if "skipped" in r else ("stopped" if r["rc"] is None else str(r["rc"]))
        wall = "" if "skipped" in r else f"{r['wall_s']:,.0f}"
        lines.append(
            f"| {r['stage']} | `{r['command']}` | {r['predicted_s']:,.0f} | {ran} | {rc} | {wall} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
