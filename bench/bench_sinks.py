"""What the metric sinks (TensorBoard, W&B offline) cost per step, against metrics.jsonl alone.

A small GPT (2 layers, d_model 128; smaller than the gpt_small of earlier runs, so that
10 pairs fit in minutes, and a short step makes a per-step cost a larger fraction) on 4
local CPU ranks (grid x=2 z=2), run with ``metrics.sinks=[jsonl,tensorboard,wandb]``
(W&B offline, as on a compute node without internet) and with ``[jsonl]``, as
``--pairs`` interleaved pairs (``bench/pairs.py``: median, IQR, load before and after).
Each run's step time is its summary's (the mean over its steps but the first). End to
end, the machine's noise is far above a 1 % target, so the sinks' own work per step is
also timed directly, in one process: TensorBoard's ``log`` of a metrics row and W&B's
``run.log`` of it.

    .venv/bin/python bench/bench_sinks.py [--steps 20] [--pairs 10]

Writes bench/results/bench_sinks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
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
from axonn_launch.common.tracking import MetricsConfig  # noqa: E402
from axonn_launch.scheduler.processes import free_port, rank_env  # noqa: E402
from bench import pairs as paired  # noqa: E402

SMALL = ModelSpec("gpt_bench", n_layer=2, d_model=128, n_head=4, vocab_size=256, max_seq_len=256)
GRID = Grid(x=2, z=2)
ON = ["jsonl", "tensorboard", "wandb"]
OFF = ["jsonl"]
ROW = {"step": 1, "loss": 5.5, "lr": 3e-3, "grad_norm": 1.2, "step_time_s": 4.5,
       "tokens_per_s": 230.0, "tflops_per_gpu": 0.02, "mfu": None, "mem_gb": 1.1,
       "elapsed_s": 4.5}  # fmt: skip


def spec_for(job_dir: Path, steps: int, sinks: list[str]) -> JobSpec:
    train = TrainConfig(steps=steps, micro_batch=4, progress=False, gemm_tuning=False,
                        eval_batches=0, checkpoint_every=0)  # fmt: skip
    return JobSpec("bench", str(job_dir), SMALL, GRID, train, RuntimeConfig(device="cpu"),
                   metrics=MetricsConfig(sinks=sinks))  # fmt: skip


def run(job_dir: Path, steps: int, sinks: list[str]) -> float:
    """The run's step time (s) from its summary."""
    job_dir.mkdir(parents=True)
    spec_for(job_dir, steps, sinks).save(job_dir / "spec.json")
    port, world = free_port(), GRID.world_size
    extra = {"PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "axonn_launch.train", str(job_dir)],
            env=rank_env(rank=r, world_size=world, port=port, extra=extra),
            stdout=subprocess.DEVNULL,
        )
        for r in range(world)
    ]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"{job_dir}: a rank failed")
    return json.loads((job_dir / "summary.json").read_text())["step_time_s"]


def direct_cost_per_row(sinks: list[str], rows: int = 2000) -> float:
    """Seconds per metrics row of the sinks' work, in this process: every row logged,
    then sent (W&B sends a row once a checkpoint covers it), closing excluded."""
    from axonn_launch.train.sinks import open_sinks

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "checkpoints").mkdir()
        (Path(tmp) / "checkpoints" / "latest").write_text(f"step_{rows}")
        spec = spec_for(Path(tmp), rows, sinks)
        opened = open_sinks(spec, start_step=0, attempt=1, enabled=True)
        assert [s.name for s in opened.sinks] == [s for s in sinks if s != "jsonl"]
        started = time.perf_counter()
        for step in range(1, rows + 1):
            opened.log(ROW | {"step": step})
        opened.checkpointed(rows)
        for sink in opened.sinks:
            if sink.name == "wandb":
                sink.send(rows)  # offline, rows go at the attempt's end: timed here
        elapsed = time.perf_counter() - started
        opened.close({"steps": rows, "final_loss": 1.0})
    return elapsed / rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=paired.MIN_PAIRS)
    args = parser.parse_args()
    os.environ["WANDB_MODE"] = "offline"
    load_before, started = paired.load_now(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        pairs = paired.interleaved(
            lambda i: run(Path(tmp) / f"on{i}", args.steps, ON),
            lambda i: run(Path(tmp) / f"off{i}", args.steps, OFF),
            args.pairs,
        )
    load_after = paired.load_now()
    off_median = statistics.median(p["off"] for p in pairs)
    direct = {name: direct_cost_per_row([name]) for name in ("tensorboard", "wandb")}
    loads = paired.load_line(load_before, load_after)
    write_results(args, pairs, off_median, direct, loads, started)


def write_results(args, pairs, off_median, direct, loads, started) -> None:
    both = sum(direct.values())
    lines = [
        "# Metric sinks (TensorBoard, W&B offline): overhead per step",
        "",
        "Script: bench/bench_sinks.py "
        f"(`.venv/bin/python bench/bench_sinks.py --steps {args.steps} --pairs {args.pairs}`)",
        "",
        f"Machine: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}; "
        f"a 2-layer GPT (d_model 128), grid x=2 z=2 (4 ranks), global batch 16 x 64 tokens, "
        f"fp32, gloo; {args.steps} steps per run; GEMM tuning off. "
        f"{loads[0].upper()}{loads[1:]}; {time.time() - started:.0f} s in all.",
        "",
        "On: `metrics.sinks=[jsonl,tensorboard,wandb]` with `metrics.wandb.mode=offline`. "
        "Off: `metrics.sinks=[jsonl]`. Interleaved pairs, the order alternating "
        "(`bench/pairs.py`).",
        "",
        *paired.pair_table(pairs),
        "",
        f"Overhead (on/off - 1): {paired.verdict(paired.ratios(pairs))}; target ≤ 1 %.",
        "",
        "The sinks' own work per metrics row, timed in one process over 2,000 rows: "
        f"TensorBoard {direct['tensorboard'] * 1e6:.0f} µs, W&B {direct['wandb'] * 1e6:.0f} µs; "
        f"together **{both / off_median:.4%}** of the median 'off' step above (rank 0 only, "
        "once per logged step).",
    ]
    text = "\n".join(lines) + "\n"
    out = REPO / "bench" / "results" / "bench_sinks.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
