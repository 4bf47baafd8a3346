"""The job side: imported only inside a job, never by the login-node launcher.

``run(spec)`` is the whole training job of one rank: bootstrap, process groups, model,
data, resume from the latest checkpoint if any, the optimizer loop, an optional sample,
and a summary (also written to ``<job_dir>/summary.json`` by rank 0).
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from axonn_launch.spec import JobSpec
from axonn_launch.train.bootstrap import DistEnv, bootstrap, init_distributed
from axonn_launch.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from axonn_launch.train.data import Loader, open_source
from axonn_launch.train.groups import build_groups
from axonn_launch.train.loop import TrainContext, build_optimizer, compute_dtype, train_loop
from axonn_launch.train.metrics import MetricsLogger
from axonn_launch.train.model import GPT
from axonn_launch.train.sample import decode, default_prompt, generate

__all__ = ["run"]


def run(
    spec: JobSpec,
    *,
    env: DistEnv | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> dict:
    """Train ``spec`` on this rank; returns the summary (losses and steps agree on all ranks)."""
    env = env or bootstrap(spec.runtime)
    if env.world_size != spec.grid.world_size:
        raise ValueError(
            f"grid {spec.grid.describe()} needs {spec.grid.world_size} ranks, "
            f"the job has {env.world_size}"
        )
    configure_threads(env)
    init_distributed(env)
    try:
        return _run_initialized(spec, env, should_stop or (lambda: False))
    finally:
        dist.destroy_process_group()
        # Groups held in reference cycles (model <-> runtime) are freed here, joining
        # their gloo worker threads while the interpreter is still whole (groups.py).
        gc.collect()


def configure_threads(env: DistEnv) -> None:
    """Share the cores among the ranks of this node unless Slurm already bound each task."""
    cores = len(os.sched_getaffinity(0))
    per_rank = cores if env.source == "slurm" else cores // max(env.local_world_size, 1)
    torch.set_num_threads(max(1, per_rank))


def _run_initialized(spec: JobSpec, env: DistEnv, should_stop: Callable[[], bool]) -> dict:
    train, grid, device = spec.train, spec.grid, torch.device(env.device)
    validate_shapes(spec)
    torch.manual_seed(train.seed)
    groups = build_groups(grid, rank=env.rank)
    model = GPT(
        spec.model,
        groups=groups,
        overlap=train.overlap,
        activation_checkpointing=train.activation_checkpointing,
        seed=train.seed,
        device=device,
    )
    optimizer = build_optimizer(model, train)
    loader = Loader(
        open_source(train.data, model_vocab=spec.model.vocab_size),
        grid=grid,
        coords=groups.coords,
        micro_batch=train.micro_batch,
        seq_len=train.seq_len,
        accumulation=train.accumulation_steps(grid),
        seed=train.seed,
        device=device,
    )
    checkpoint = latest_checkpoint(spec.job_dir)
    start_step = 0
    if checkpoint is not None:
        start_step = resume(checkpoint, spec, env, model, optimizer, loader)
    logger = MetricsLogger(
        job_dir=Path(spec.job_dir),
        model=spec.model,
        seq_len=train.seq_len,
        recompute=train.activation_checkpointing,
        world_size=env.world_size,
        peak_tflops_per_gpu=spec.runtime.peak_tflops_per_gpu,
        total_steps=train.steps,
        device=device,
        enabled=env.rank == 0,
        progress=train.progress,
    )
    if env.rank == 0:
        truncate_metrics(Path(spec.job_dir) / "metrics.jsonl", start_step)
    ctx = TrainContext(
        train=train,
        groups=groups,
        loader=loader,
        optimizer=optimizer,
        logger=logger,
        device=device,
        tokens_per_step=train.global_batch * train.seq_len,
        start_step=start_step,
        should_stop=should_stop,
        save=lambda step: save(spec, env, step, model, optimizer, loader),
    )
    summary = train_loop(model, ctx)
    if train.sample_tokens > 0:
        summary["sample"] = print_sample(spec, env, model, device)
    logger.finish(summary)
    if env.rank == 0:
        (Path(spec.job_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def validate_shapes(spec: JobSpec) -> None:
    train, grid = spec.train, spec.grid
    if train.seq_len > spec.model.max_seq_len:
        raise ValueError(f"seq_len={train.seq_len} > model max_seq_len={spec.model.max_seq_len}")
    if train.micro_batch % grid.z:
        raise ValueError(f"micro_batch={train.micro_batch} is not divisible by grid.z={grid.z}")
    per_step = train.micro_batch * grid.data
    if train.global_batch % per_step:
        raise ValueError(
            f"global_batch={train.global_batch} is not a multiple of micro_batch*data={per_step}"
        )


def resume(
    checkpoint: Path,
    spec: JobSpec,
    env: DistEnv,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    loader: Loader,
) -> int:
    """Load this rank's state from ``checkpoint``; returns the optimizer steps it had done.

    A checkpoint written on another grid is re-sharded (``axonn_launch.train.reshard``).
    """
    device = torch.device(env.device)
    meta = json.loads((checkpoint / "meta.json").read_text())
    if meta.get("grid") != spec.grid.as_dict():
        from axonn_launch.train.reshard import load_resharded

        loader_state, rng = load_resharded(
            checkpoint,
            meta,
            model=model,
            optimizer=optimizer,
            loader=loader,
            groups=model.groups,
            device=device,
        )
        loader.load_state_dict(loader_state)
        set_rng_state(rng, device)
        return int(meta["step"])
    state, meta = load_checkpoint(checkpoint, rank=env.rank, grid=spec.grid, map_location=device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    set_rng_state(state["rng"], device)
    return int(meta["step"])


def save(
    spec: JobSpec,
    env: DistEnv,
    step: int,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    loader: Loader,
) -> None:
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "loader": loader.state_dict(),
        "rng": rng_state(torch.device(env.device)),
    }
    meta = {"grid": spec.grid.as_dict(), "world_size": env.world_size, "model": asdict(spec.model)}
    save_checkpoint(
        spec.job_dir,
        step=step,
        rank=env.rank,
        state=state,
        meta=meta,
        keep=spec.train.keep_checkpoints,
    )


def truncate_metrics(path: Path, start_step: int) -> None:
    """On resume, drop rows logged after the checkpoint so each step appears once."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line)["step"] <= start_step]
    path.write_text("".join(line + "\n" for line in kept))


def print_sample(spec: JobSpec, env: DistEnv, model: GPT, device: torch.device) -> str:
    tokens = generate(
        model,
        default_prompt(spec.train.data),
        spec.train.sample_tokens,
        max_seq_len=spec.model.max_seq_len,
        device=device,
        dtype=compute_dtype(spec.train, device),
        seed=spec.train.seed,
        group=model.groups.world,
    )
    text = decode(tokens, spec.train.data)
    if env.rank == 0:
        print(f"--- sample ({spec.train.sample_tokens} tokens) ---\n{text}\n---", flush=True)
    return text
