"""Wall time of the default local job: gpt_tiny on the built-in corpus, 4 CPU ranks.

Starts one ``python -m axonn_launch.train`` process per rank (torchrun-style variables,
as the local launcher does), for each grid given, and reports the wall time including
process start-up, the training time, throughput and the loss curve's ends.

    .venv/bin/python bench/bench_train_loop.py [--steps 200] [--grids x2z2 data2z2 ...]
        [--micro-batches 4 16]

Writes a markdown table to bench/results/bench_train_loop.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from axonn_launch.common.grid import Grid  # noqa: E402
from axonn_launch.common.models import ModelSpec  # noqa: E402
from axonn_launch.common.spec import JobSpec, RuntimeConfig, TrainConfig  # noqa: E402
from axonn_launch.scheduler.processes import free_port, rank_env  # noqa: E402

TINY = ModelSpec("gpt_tiny", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=64)


def parse_grid(text: str) -> Grid:
    sizes = {axis: int(n) for axis, n in re.findall(r"(data|x|y|z)(\d+)", text)}
    return Grid(**sizes)


def run_job(job_dir: Path, grid: Grid, steps: int, micro_batch: int) -> dict:
    spec = JobSpec(
        name="bench",
        job_dir=str(job_dir),
        model=TINY,
        grid=grid,
        train=TrainConfig(steps=steps, micro_batch=micro_batch, progress=False),
        runtime=RuntimeConfig(device="cpu"),
    )
    job_dir.mkdir(parents=True)
    spec.save(job_dir / "spec.json")
    port, world = free_port(), grid.world_size
    started = time.perf_counter()
    procs = []
    for rank in range(world):
        env = rank_env(rank=rank, world_size=world, port=port, extra={"PYTHONPATH": str(REPO)})
        command = [sys.executable, "-m", "axonn_launch.train", str(job_dir)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"grid {grid.describe()}: a rank failed")
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((job_dir / "summary.json").read_text())
    return {
        "grid": grid.describe(),
        "micro_batch": micro_batch,
        "accumulation": spec.train.accumulation_steps(grid),
        "wall_s": wall,
        "train_s": rows[-1]["elapsed_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
        "mem_gb": rows[-1]["mem_gb"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--grids", nargs="+", default=["x2z2", "data2z2", "x2y2", "data4"])
    parser.add_argument(
        "--micro-batches", nargs="+", type=int, default=[4], help="sequences per micro-step"
    )
    args = parser.parse_args()
    results, load_start = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for text in args.grids:
            for micro in args.micro_batches:
                grid = parse_grid(text)
                if 16 % (micro * grid.data):
                    continue  # global batch 16 must be a multiple of micro_batch * data
                job = Path(tmp) / f"job{len(results)}"
                results.append(run_job(job, grid, args.steps, micro))
                print(results[-1], flush=True)
    lines = [
        f"# Training loop: gpt_tiny, {args.steps} steps, 4 CPU ranks",
        "",
        f"Machine: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}; "
        f"global batch 16 x 64 tokens; fp32; gloo.",
        f"Command: `.venv/bin/python bench/bench_train_loop.py --steps {args.steps} "
        f"--grids {' '.join(args.grids)} "
        f"--micro-batches {' '.join(map(str, args.micro_batches))}`",
        f"Load average (1 min) at start {load_start:.1f}, at end {os.getloadavg()[0]:.1f}; "
        "other work on the machine inflates the times.",
        "",
        "| grid | micro-batch x accumulation | wall s (incl. start-up) | training s | tokens/s "
        "| loss step 1 | loss last | peak RSS GiB/rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['grid']} | {r['micro_batch']} x {r['accumulation']} | {r['wall_s']:.1f} "
            f"| {r['train_s']:.1f} | {r['tokens_per_s']:.0f} "
            f"| {r['first_loss']:.3f} | {r['last_loss']:.3f} | {r['mem_gb']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    out = REPO / "bench" / "results" / "bench_train_loop.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
