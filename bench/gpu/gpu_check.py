"""The first GPU hour, prepared: one command that checks the job side on one GPU.

    bench/gpu/run.sh OUT            # on the device: wheels, versions, then every stage
    python bench/gpu/gpu_check.py --out OUT --cpu   # the same stages, tiny, on CPU

Stages (each with its own time budget; the report is written after each one): exactness
on the device against CPU, MFU of a 1.3B GPT against a plain SDPA GPT, the memory model
against torch.cuda.max_memory_allocated, the planner with and without a calibration made
on the device, and throughput pieces. The parent process imports no torch: it runs the
stages in a child and, when a stage hangs in C code past its budget, kills the child,
reports the stage as cut and starts a new child for the rest. What each figure means and
the command to make a run: bench/gpu/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # gpu_stages, axonn_launch

STAGES = {  # name: budget in seconds on the device (the --cpu run gets CPU_BUDGET_S each)
    "exactness": 75,
    "mfu": 120,
    "memory": 90,
    "planner": 90,
    "pieces": 90,
}
CPU_BUDGET_S = 60
REQUIRED = ("torch", "hydra", "omegaconf", "submitit")  # what the job side and launcher import


def report_paths(out: Path) -> tuple[Path, Path]:
    return out / "gpu_report.json", out / "gpu_report.md"


def write_report(out: Path, report: dict) -> None:
    """The JSON report and its Markdown summary, rewritten whole after each stage."""
    json_path, md_path = report_paths(out)
    json_path.write_text(json.dumps(report, indent=2, default=str))
    md_path.write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report.get('device', {}).get('name', '?')}", ""]
    lines += [f"- {k}: {v}" for k, v in report.get("device", {}).items()]
    for name, stage in report.get("stages", {}).items():
        lines += ["", f"## {name}: {stage.get('status')} ({stage.get('seconds', 0):.1f} s)", ""]
        for key, value in stage.get("results", {}).items():
            lines.append(f"- {key}: {json.dumps(value, default=str)}")
        if stage.get("error"):
            lines.append(f"- error: {stage['error']}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- parent


def run_all(out: Path, cpu: bool) -> int:
    """Run every stage in child processes; a cut stage does not stop the next."""
    out.mkdir(parents=True, exist_ok=True)
    report = {"mode": "cpu" if cpu else "gpu", "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    report["budgets_s"] = {n: CPU_BUDGET_S if cpu else b for n, b in STAGES.items()}
    write_report(out, report)
    pending = list(STAGES)
    while pending:
        budget = sum(report["budgets_s"][n] for n in pending) + 60  # + imports and set-up
        cmd = [sys.executable, __file__, "--child", "--out", str(out), "--stages", *pending]
        cmd += ["--cpu"] if cpu else []
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(cmd, timeout=budget, check=False)
        report = json.loads(report_paths(out)[0].read_text())
        if "device" not in report:
            print(report.get("stop", "gpu_check: the child wrote no device line"), file=sys.stderr)
            return 2
        if not report.get("printed"):
            print("gpu_check: " + ", ".join(f"{k} {v}" for k, v in report["device"].items()))
            report["printed"] = True
        done = report.get("stages", {})
        running = [n for n in pending if done.get(n, {}).get("status") == "running"]
        for name in running:  # killed while in C code: the one stage a hang can eat
            done[name].update(status="cut", error="killed at the stage's budget (a hang)")
        pending = [n for n in pending if n not in done]
        write_report(out, report)
    statuses = {n: s["status"] for n, s in report["stages"].items()}
    print(f"gpu_check: {statuses}; report in {report_paths(out)[0]}")
    return 0 if all(s == "ok" for s in statuses.values()) else 1


# --------------------------------------------------------------------------- child


def child(out: Path, stages: list[str], cpu: bool) -> None:
    report = json.loads(report_paths(out)[0].read_text())
    missing = [m for m in REQUIRED if not _importable(m)]
    if missing:
        report["stop"] = f"gpu_check: missing {', '.join(missing)}: install bench/gpu/wheels first"
        write_report(out, report)
        return
    import gpu_stages as staged

    try:
        ctx = staged.Context.make(cpu, out)
    except staged.StageStop as exc:
        report["stop"] = f"gpu_check: {exc}"
        write_report(out, report)
        return
    report["device"] = ctx.versions()
    report.setdefault("stages", {})
    for name in stages:
        budget = report["budgets_s"][name]
        report["stages"][name] = {"status": "running", "budget_s": budget}
        write_report(out, report)
        report["stages"][name] = staged.run_stage(name, ctx, budget, report)
        write_report(out, report)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_report.json and .md")
    parser.add_argument("--cpu", action="store_true", help="tiny models on CPU, seconds")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stages", nargs="*", default=list(STAGES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(Path(args.out), args.stages, args.cpu)
        return 0
    return run_all(Path(args.out), args.cpu)


if __name__ == "__main__":
    sys.exit(main())
