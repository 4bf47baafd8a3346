"""``rehearse=rank [rehearse_rank=R]``: one rank of the job, on this computer, before the
queue ("will my rank fit, and how long will its init take?").

The launch is composed, resolved and planned as a real one and written as a dry run
(nothing submitted); then rank R of that job runs here as a local process,
``python -m axonn_launch.train.rehearse.rank <job_dir>``, with torch's fake process
group at the job's full world size (``train/rehearse/rank.py`` says what is real). This
module hands it the cost model's figures for that rank and prints its record as a table.
Never imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

from axonn_launch.config.compose import ConfigError, LaunchConfig
from axonn_launch.config.resolve import Resolved
from axonn_launch.cost.memory import GIB
from axonn_launch.cost.startup import restart

REQUEST = "rank_rehearsal_request.json"  # the job side's names (train/rehearse/rank.py)
RECORD = "rank_rehearsal.json"
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and two AdamW moments
# glibc raises its mmap threshold to the size of each large block freed, after which freed
# activations stay in the heap as RSS: 4 layers of gpt_320b's rank at 1,024 tokens peaked
# 1.6x the memory model in backward, 0.8x with the threshold fixed (docs/scale.md)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def check_rank(cfg: LaunchConfig, resolved: Resolved) -> None:
    """``rehearse_rank`` names a rank of the resolved job; else one line (ConfigError)."""
    rank, world = cfg.rehearse_rank, resolved.grid.world_size
    if rank is None or 0 <= rank < world:
        return
    raise ConfigError(
        f"rehearse_rank={rank}: the job has {world} ranks (grid {resolved.grid.describe()},"
        f" {resolved.nodes} nodes x {resolved.tasks_per_node}); valid: 0..{world - 1}"
    )


def rank_request(cfg: LaunchConfig, resolved: Resolved) -> dict[str, Any]:
    """What the rank runs and the cost model's figures for it."""
    grid, rank = resolved.grid, cfg.rehearse_rank or 0
    writers = grid.world_size // grid.data  # data index 0 writes the checkpoint
    writes = grid.coords(rank).data == 0
    params = resolved.cfg.model.n_params()
    return {
        "rank": rank,
        "micro_steps": min(2, resolved.train.accumulation_steps(grid)),
        "threads": resolved.train.threads or len(os.sched_getaffinity(0)),
        "tasks_per_node": resolved.tasks_per_node,
        "model_terms": dict(resolved.memory.terms),
        "checkpoint_bytes": CHECKPOINT_BYTES_PER_PARAM * params / writers if writes else 0,
        "predicted": {
            "init_s": None,  # the cost model has no init time of its own
            "restart_s": restart(resolved.cfg.machine, resolved.nodes).seconds,
            "step_s_on_gpu": resolved.step_time.total if resolved.step_time else None,
        },
    }


def after_launch(cfg: LaunchConfig, resolved: Resolved, outcome: Any, out: TextIO = sys.stdout):
    """Run the rank when ``rehearse=rank`` and the dry run was written; the outcome with
    the rank's status (``completed`` or ``failed``)."""
    if cfg.rehearse_rank is None or outcome.status != "dry_run":
        return outcome
    job_dir = Path(outcome.job_dir)
    (job_dir / REQUEST).write_text(json.dumps(rank_request(cfg, resolved), indent=1) + "\n")
    print(f"rank {cfg.rehearse_rank}: running here with fake collectives ...", file=out, flush=True)
    command = [sys.executable, "-m", "axonn_launch.train.rehearse.rank", str(job_dir)]
    done = subprocess.run(command, check=False, env={**MALLOC_ENV, **os.environ})
    if done.returncode != 0 or not (job_dir / RECORD).exists():
        print(f"rank {cfg.rehearse_rank}: failed; its traceback is above", file=sys.stderr)
        return dataclasses.replace(outcome, status="failed")
    print(table(json.loads((job_dir / RECORD).read_text())), file=out)
    return dataclasses.replace(outcome, status="completed")


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def table(record: dict) -> str:
    """Phase, seconds, peak RSS above the baseline and the cost model's figure, then the
    totals (``RECORD``'s fields)."""
    lines = [f"{'phase':<16}{'seconds':>10}{'peak RSS GiB':>14}{'model GiB':>11}"]
    for row in record["phases"]:
        name = row["phase"] + (f" {row['micro_step']}" if "micro_step" in row else "")
        lines.append(
            f"{name:<16}{row['seconds']:>10.2f}{gib(row['peak_above_baseline_bytes']):>14}"
            f"{gib(row['model_bytes']):>11}"
        )
    ratio, ck = record["ratio_to_model"], record["checkpoint"]
    lines += [
        f"peak {gib(record['peak_above_baseline_bytes'])} GiB above a baseline of"
        f" {gib(record['baseline_rss_bytes'])} GiB (torch, fake world joined, kernels warmed), in"
        f" {record['peak_phase']}; the memory model: {gib(record['model_bytes'])} GiB"
        " without its runtime reserve" + (f" (ratio {ratio:.2f})" if ratio is not None else ""),
        f"groups: {record['phases'][0]['groups_created']} created in"
        f" {record['groups_seconds']:.2f} s",
        f"checkpoint: {ck['bytes_written']:,} bytes written (cost model: "
        f"{ck['predicted_bytes'] or 0:,.0f}), reloaded"
        f" {'equal' if ck['reloaded_equal'] else 'DIFFERENT'}",
        f"{record['label']}; record: {RECORD} in the job dir",
    ]
    return "\n".join(lines)
