"""One real rank of each headline point, on this computer (issue 46, part 3): the launcher's
``rehearse=rank`` for gpt_320b and gpt_640b on 4,096 Frontier nodes (32,768 GCDs) and the
Llama 3.1 405B fine-tune there, one point at a time, each under a cgroup v1 memory limit.

A point runs when the memory model's figure for its rank (without the GPU runtime
reserve) fits the limit, and ``MemAvailable`` leaves room for it beside the other users
of this machine; else it is recorded as not run, with the reason. Every figure is
measured on one real rank with fake collectives (torch's fake process group): memory and
local compute are the rank's, collectives communicate nothing.

A block's forward and backward at gpt_320b's 4,096 tokens per rank take about a minute of
one core here, so each point runs ``--depth`` of its blocks (default 4) on the full job's
grid and micro-batch (``at_depth``); ``--depth 100`` runs gpt_320b whole (about 30 min).

    python bench/scale/rank_points.py [--only NAME] [--depth N] [--limit-gib 20]
        # merges into bench/results/rank_rehearsal.json; writes rank_rehearsal.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
RECORD = RESULTS / "rank_rehearsal.json"
GIB = 1024**3
POINTS = {  # name: launcher arguments (rank: the middle of the job, data index 0)
    "gpt_320b_frontier_4096": ["machine=frontier", "model=gpt_320b", "nodes=4096"],
    "gpt_640b_frontier_4096": ["machine=frontier", "model=gpt_640b", "nodes=4096"],
    "llama3_405b_sft_frontier_4096": [
        "machine=frontier", "model=llama3_405b", "finetune=sft", "nodes=4096",
    ],
}  # fmt: skip
RANK = 12345
LIMIT_NOTE = "20 GiB cgroup v1 memory limit"
MARGIN_GIB = 2.0  # MemAvailable must exceed the point's model figure by this much


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def memory_cgroup(name: str, limit: int) -> Path:
    """A child of this process's cgroup v1 memory group, limited to ``limit`` bytes."""
    own = next(
        line.split(":", 2)[2]
        for line in Path("/proc/self/cgroup").read_text().splitlines()
        if line.split(":")[1] == "memory"
    )
    group = Path("/sys/fs/cgroup/memory" + own.rstrip("/")) / name
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(limit))
    return group


def predicted(args: list[str], job: Path) -> dict:
    """The dry run's figures for the point: its summary lines, and its spec."""
    out = run_launcher([*args, "dry_run=true", f"hydra.run.dir={job}"])
    lines = {ln.split(None, 1)[0]: ln for ln in out.stdout.splitlines() if ln[:1].isalpha()}
    return {"memory_line": lines.get("memory", ""), "grid_line": lines.get("grid", "")}


def run_launcher(args: list[str], group: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "axonn_launch", *args]

    def enter() -> None:
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, preexec_fn=enter)


def resolved_point(args: list[str]):
    sys.path.insert(0, str(ROOT))
    from axonn_launch.config.compose import load
    from axonn_launch.config.resolve import resolve

    return resolve(load([*args, "dry_run=true"]))


def model_gib(resolved) -> float:
    """The memory model's figure for one rank, GiB, without the GPU runtime reserve."""
    terms = resolved.memory.terms
    return sum(v for k, v in terms.items() if k != "runtime reserve") / GIB


def at_depth(args: list[str], resolved, depth: int) -> list[str]:
    """The point with ``depth`` of its blocks, on its full point's grid and micro-batch:
    every per-block shape is the full job's (a block's forward and backward at 4,096
    tokens per rank take about a minute of one core here, so 100 blocks would take hours)."""
    grid = resolved.grid
    return [
        *args, f"model.n_layer={depth}", f"grid.data={grid.data}", f"grid.x={grid.x}",
        f"grid.y={grid.y}", f"grid.z={grid.z}", f"train.micro_batch={resolved.train.micro_batch}",
    ]  # fmt: skip


def run_point(name: str, limit: int, jobs: Path, depth: int) -> dict:
    full = resolved_point([*POINTS[name], "train.threads=1"])
    layers = full.cfg.model.n_layer
    args = at_depth([*POINTS[name], "train.threads=1"], full, depth)
    need = model_gib(resolved_point(args))
    command = " ".join([*args, "rehearse=rank", f"rehearse_rank={RANK}"])
    entry = {"point": name, "command": f"python -m axonn_launch {command}",
             "layers": layers, "depth": depth, "model_gib_full_depth": model_gib(full),
             "model_gib": need}  # fmt: skip
    if model_gib(full) * GIB > limit:
        why = (
            f"the memory model gives {model_gib(full):.1f} GiB for the rank at its"
            f" {layers} blocks, over the {limit / GIB:.0f} GiB this machine can lend one point"
        )
        return {**entry, "run": False, "why": why}
    if mem_available() < need * GIB + MARGIN_GIB * GIB:
        why = (
            f"MemAvailable {mem_available() / GIB:.1f} GiB leaves no room for"
            f" {need:.1f} GiB + {MARGIN_GIB} GiB beside the machine's other users"
        )
        return {**entry, "run": False, "why": why}
    job = jobs / f"{name}_{depth}"
    group = memory_cgroup(f"rank_points_{os.getpid()}", limit)
    started = time.perf_counter()
    done = run_launcher([*args, "rehearse=rank", f"rehearse_rank={RANK}",
                         f"hydra.run.dir={job}"], group)  # fmt: skip
    entry["wall_s"] = time.perf_counter() - started
    entry["cgroup_max_usage_bytes"] = int((group / "memory.max_usage_in_bytes").read_text())
    group.rmdir()
    if done.returncode != 0:
        return {**entry, "run": False, "why": f"rc {done.returncode}: {done.stderr[-800:]}"}
    record = json.loads((job / "rank_rehearsal.json").read_text())
    table = done.stdout[done.stdout.find("phase ") :]
    return {**entry, "run": True, "record": record, "table": table, "job_dir": str(job)}


def markdown(points: dict) -> str:
    lines = [
        "# One rank of the paper's jobs, here (fake collectives)",
        "",
        "Script: bench/scale/rank_points.py (`python bench/scale/rank_points.py`, and"
        " `--only gpt_320b_frontier_4096 --depth 100`). Each point is `rehearse=rank` for"
        f" rank {RANK}, under a {LIMIT_NOTE}; peak RSS above the process's baseline (torch"
        " imported, the fake world joined, a tiny step run) against the memory model"
        " without its GPU runtime reserve. A point at 4 blocks runs them on the full job's"
        " grid and micro-batch: every per-block shape is the job's.",
        "",
    ]
    for entry in points.values():
        lines.append(
            f"**{entry['point']}**, {entry['depth']} of its {entry['layers']} blocks"
            f" (`{entry['command']}`; the memory model at full depth:"
            f" {entry['model_gib_full_depth']:.1f} GiB without its runtime reserve)"
        )
        if entry["run"]:
            lines += ["", "```", entry["table"].rstrip(), "```", ""]
        else:
            lines += ["", f"not run: {entry['why']}", ""]
    lines.append(
        "Every figure measured on one real rank with fake collectives (torch's fake process"
        " group), 1 CPU thread, on this shared 2-core machine; made by"
        " `python bench/scale/rank_points.py`."
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=sorted(POINTS), action="append")
    parser.add_argument("--limit-gib", type=float, default=20.0)
    parser.add_argument("--jobs", type=Path, default=Path("/tmp/rank_points"))
    parser.add_argument("--depth", type=int, default=4, help="blocks of each model to run")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md")
    args = parser.parse_args()
    if args.markdown_only:
        points = json.loads(RECORD.read_text())["points"]
        (RESULTS / "rank_rehearsal.md").write_text(markdown(points))
        return 0
    for name in args.only or list(POINTS):
        print(f"{name}: running", flush=True)
        entry = run_point(name, int(args.limit_gib * GIB), args.jobs, args.depth)
        key = name if entry["depth"] >= entry["layers"] else f"{name} ({entry['depth']} blocks)"
        print(entry.get("table") or entry.get("why"), flush=True)
        RESULTS.mkdir(exist_ok=True)  # read just before writing: another run may have added
        points = json.loads(RECORD.read_text())["points"] if RECORD.exists() else {}
        points[key] = entry
        label = "measured on one real rank with fake collectives"
        RECORD.write_text(json.dumps({"label": label, "points": points}, indent=1) + "\n")
        (RESULTS / "rank_rehearsal.md").write_text(markdown(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
