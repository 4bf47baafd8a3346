"""compose -> validate -> plan -> render -> submit, for one configuration.

Never imports torch: this runs on login nodes.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from axonn_launch import local, render, slurm
from axonn_launch.config import LaunchConfig
from axonn_launch.job import TrainJob
from axonn_launch.memory import GIB
from axonn_launch.spec import JobSpec, RuntimeConfig
from axonn_launch.validate import Resolved, resolve

EXIT_OK, EXIT_JOB_FAILED, EXIT_BAD_INPUT = 0, 1, 2


@dataclass(frozen=True)
class Outcome:
    status: str  # dry_run | submitted | completed | failed | invalid
    job_dir: str
    job_id: str = ""
    nodes: int = 0
    message: str = ""

    @property
    def exit_code(self) -> int:
        if self.status == "invalid":
            return EXIT_BAD_INPUT
        return EXIT_JOB_FAILED if self.status == "failed" else EXIT_OK


def launch(
    cfg: LaunchConfig, *, job_dir: Path, config: dict, command_line: list[str], out=sys.stdout
) -> Outcome:
    """Validate, write the job directory, then dry-run, run locally or submit."""
    resolved = resolve(cfg)  # raises ConfigError before anything is written
    for warning in resolved.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    job_dir = job_dir.resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    spec = job_spec(cfg, resolved, job_dir)
    spec.save(job_dir / "spec.json")
    config_yaml = resolved_yaml(config, resolved)
    (job_dir / "config.yaml").write_text(config_yaml)
    script = batch_script(cfg, resolved, job_dir)
    if script:
        (job_dir / "submission.sh").write_text(script)
    record = job_record(cfg, resolved, job_dir, command_line)
    print(summary(cfg, resolved, job_dir), file=out)
    if cfg.dry_run:
        print("--- resolved config ---", file=out)
        print(config_yaml, file=out)
        print("--- batch script ---" if script else "--- local command ---", file=out)
        print(script or local_command_text(cfg, resolved, job_dir), file=out)
        write_record(job_dir, record, status="dry_run")
        return Outcome("dry_run", str(job_dir), nodes=resolved.nodes)
    if cfg.machine.scheduler == "local":
        return run_local(cfg, resolved, job_dir, record)
    return submit_slurm(cfg, resolved, job_dir, record, out=out)


def resolved_yaml(config: dict, resolved: Resolved) -> str:
    """The composed config with what validation fixed: grid, nodes, planner's micro-batch."""
    from omegaconf import OmegaConf

    config = dict(config)
    config["grid"] = {**resolved.grid.as_dict(), "auto": resolved.planned}
    config["nodes"] = resolved.nodes
    config["train"] = {**config.get("train", {}), "micro_batch": resolved.train.micro_batch}
    return OmegaConf.to_yaml(OmegaConf.create(config))


def job_spec(cfg: LaunchConfig, resolved: Resolved, job_dir: Path) -> JobSpec:
    runtime = RuntimeConfig(
        backend=cfg.machine.backend,
        device="cpu" if cfg.machine.hardware.gpu_model == "cpu" else "auto",
        device_index=cfg.machine.device_index,
        peak_tflops_per_gpu=cfg.machine.hardware.peak_tflops_per_gpu,
        master_port=cfg.machine.master_port,
    )
    return JobSpec(
        name=cfg.name,
        job_dir=str(job_dir),
        model=cfg.model,
        grid=resolved.grid,
        train=resolved.train,
        runtime=runtime,
    )


def batch_script(cfg: LaunchConfig, resolved: Resolved, job_dir: Path) -> str:
    if cfg.machine.scheduler != "slurm":
        return ""
    return render.render_script(
        machine=cfg.machine,
        nodes=resolved.nodes,
        tasks_per_node=resolved.tasks_per_node,
        job_name=cfg.name,
        folder=slurm_folder(job_dir),
        python=sys.executable,
    )


def slurm_folder(job_dir: Path) -> Path:
    return job_dir / "slurm" / "%j"


def local_command_text(cfg: LaunchConfig, resolved: Resolved, job_dir: Path) -> str:
    command = shlex.join([sys.executable, "-m", "axonn_launch.train", str(job_dir)])
    return (
        f"# {resolved.grid.world_size} local processes, each with RANK, WORLD_SIZE, LOCAL_RANK,"
        f" MASTER_ADDR, MASTER_PORT set:\n{command}"
    )


def summary(cfg: LaunchConfig, resolved: Resolved, job_dir: Path) -> str:
    params = cfg.model.n_params()
    memory = resolved.memory
    per = "rank" if cfg.machine.hardware.gpu_model == "cpu" else "GPU"
    mem = f"{memory.total / GIB:.2f} GiB per {per} (largest: {memory.biggest()[0]})"
    scale = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.2f} M"
    return "\n".join(
        [
            f"job        {cfg.name}",
            f"machine    {cfg.machine.name} ({cfg.machine.hardware.gpu_model})",
            f"model      {cfg.model.name}: {params:,} parameters ({scale})",
            f"grid       {resolved.grid.describe()} = {resolved.grid.world_size} ranks"
            + (
                f" (planner's best; micro_batch={resolved.train.micro_batch})"
                if resolved.planned
                else ""
            ),
            f"nodes      {resolved.nodes} x {resolved.tasks_per_node} tasks",
            f"memory     {mem}",
            f"job dir    {job_dir}",
        ]
    )


def planner_note(pick: int, micro_batch: int) -> str:
    which = "best" if pick == 0 else f"choice {pick + 1}"
    return f" (planner's {which}; micro_batch={micro_batch})"


def job_record(
    cfg: LaunchConfig, resolved: Resolved, job_dir: Path, command_line: list[str]
) -> dict:
    return {
        "name": cfg.name,
        "job_dir": str(job_dir),
        "job_ids": [],
        "machine": cfg.machine.name,
        "scheduler": cfg.machine.scheduler,
        "model": cfg.model.name,
        "n_params": cfg.model.n_params(),
        "grid": resolved.grid.as_dict(),
        "nodes": resolved.nodes,
        "tasks_per_node": resolved.tasks_per_node,
        "steps": resolved.train.steps,
        "submit_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "attempt": 1,
        "lineage": [],
        "command_line": command_line,
        "dry_run": cfg.dry_run,
    }


def write_record(job_dir: Path, record: dict, **updates) -> dict:
    record.update(updates)
    tmp = job_dir / "job.json.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    tmp.replace(job_dir / "job.json")
    return record


def run_local(cfg: LaunchConfig, resolved: Resolved, job_dir: Path, record: dict) -> Outcome:
    procs = local.start_ranks(
        job_dir=job_dir, world_size=resolved.grid.world_size, env=dict(cfg.machine.env)
    )
    job_id = f"local-{procs[0].pid}"
    write_record(job_dir, record, job_ids=[job_id], status="running")
    if cfg.wait is False:
        print(f"started {job_id}; job dir {job_dir}")
        return Outcome("submitted", str(job_dir), job_id, resolved.nodes)
    code = local.wait_ranks(procs)
    status = "completed" if code == 0 else "failed"
    write_record(job_dir, record, status=status, exit_code=code)
    return Outcome(status, str(job_dir), job_id, resolved.nodes, f"exit code {code}")


def submit_slurm(
    cfg: LaunchConfig, resolved: Resolved, job_dir: Path, record: dict, *, out
) -> Outcome:
    params = render.slurm_parameters(
        machine=cfg.machine,
        nodes=resolved.nodes,
        tasks_per_node=resolved.tasks_per_node,
        job_name=cfg.name,
    )
    job = slurm.submit(
        folder=slurm_folder(job_dir),
        params=params,
        job=TrainJob(str(job_dir), cfg.machine.task_env),
        max_requeue=cfg.max_requeue,
    )
    write_record(job_dir, record, job_ids=[job.job_id], status="submitted")
    print(f"submitted job {job.job_id} ({resolved.nodes} nodes); job dir {job_dir}", file=out)
    if not cfg.wait:
        return Outcome("submitted", str(job_dir), job.job_id, resolved.nodes)
    state = slurm.follow(job, out=out)
    status = "completed" if state == "COMPLETED" else "failed"
    write_record(job_dir, record, status=status, slurm_state=state)
    return Outcome(status, str(job_dir), job.job_id, resolved.nodes, state)
