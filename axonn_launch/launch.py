"""compose -> validate -> plan -> render -> submit, for one configuration.

Never imports torch: this runs on login nodes.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from axonn_launch import local, rankfail, render, slurm
from axonn_launch.config import LaunchConfig
from axonn_launch.job import TrainJob
from axonn_launch.jobs import (
    PREFLIGHT_EXPECTED_FILE,
    current_job_id,
    record_lock,
    write_record_file,
)
from axonn_launch.memory import GIB
from axonn_launch.spec import JobSpec, RuntimeConfig
from axonn_launch.validate import Resolved, resolve

EXIT_OK, EXIT_JOB_FAILED, EXIT_BAD_INPUT = 0, 1, 2

# The console gets print(); the job dir's axonn_launch.log (Hydra's file handler) gets log.
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    status: str  # dry_run | submitted | completed | failed | invalid | refused (by sbatch)
    job_dir: str
    job_id: str = ""
    nodes: int = 0
    message: str = ""

    @property
    def exit_code(self) -> int:
        if self.status == "invalid":
            return EXIT_BAD_INPUT
        return EXIT_JOB_FAILED if self.status in ("failed", "refused") else EXIT_OK


def launch(
    cfg: LaunchConfig, *, job_dir: Path, config: dict, command_line: list[str], out=sys.stdout
) -> Outcome:
    """Validate, write the job directory, then dry-run, run locally or submit."""
    resolved = resolve(cfg)  # raises ConfigError before anything is written
    for warning in resolved.warnings:
        print(f"warning: {warning}", file=sys.stderr)
        log.warning(warning)
    job_dir = job_dir.resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    spec = job_spec(cfg, resolved, job_dir)
    spec.save(job_dir / "spec.json")
    write_preflight_expectations(cfg, job_dir)
    config_yaml = resolved_yaml(config, resolved)
    (job_dir / "config.yaml").write_text(config_yaml)
    script = batch_script(cfg, resolved, job_dir)
    if script:
        (job_dir / "submission.sh").write_text(script)
    record = job_record(cfg, resolved, job_dir, command_line)
    report = summary(cfg, resolved, job_dir)
    print(report, file=out)
    log.info("%s\n%s", "dry run: nothing is started" if cfg.dry_run else "launching", report)
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
    config["train"] = {
        **config.get("train", {}),
        "micro_batch": resolved.train.micro_batch,
        "cache_layers": resolved.train.cache_layers,
    }
    return OmegaConf.to_yaml(OmegaConf.create(config))


def preflight_on(cfg: LaunchConfig) -> bool:
    """``preflight`` as given; unset (null): on for Slurm machines, off on this computer."""
    return cfg.preflight if cfg.preflight is not None else cfg.machine.scheduler == "slurm"


def write_preflight_expectations(cfg: LaunchConfig, job_dir: Path) -> None:
    """What the job's preflight compares with, from the machine profile (or nothing)."""
    path = job_dir / PREFLIGHT_EXPECTED_FILE
    if not preflight_on(cfg):
        path.unlink(missing_ok=True)
        return
    path.write_text(json.dumps(asdict(cfg.machine.preflight_expectations()), indent=2) + "\n")


def job_spec(cfg: LaunchConfig, resolved: Resolved, job_dir: Path) -> JobSpec:
    runtime = RuntimeConfig(
        backend=cfg.machine.backend,
        device="cpu" if cfg.machine.hardware.gpu_model == "cpu" else "auto",
        device_index=cfg.machine.device_index,
        peak_tflops_per_gpu=cfg.machine.hardware.peak_tflops_per_gpu,
        master_port=cfg.machine.master_port,
        preflight=preflight_on(cfg),
    )
    return JobSpec(
        name=cfg.name,
        job_dir=str(job_dir),
        model=cfg.model,
        grid=resolved.grid,
        train=resolved.train,
        runtime=runtime,
        generate=cfg.generate,
        memorization=cfg.memorization,
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
        python=sys.executable,  # the login node's; a container machine names its own
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
    grid, train = resolved.grid, resolved.train
    note = planner_note(cfg.grid.pick) if resolved.planned else ""
    how = " (automatic)" if cfg.train.micro_batch is None else ""
    return "\n".join(
        [
            f"job        {cfg.name}",
            f"machine    {cfg.machine.name} ({cfg.machine.hardware.gpu_model})",
            f"model      {cfg.model.name}: {params:,} parameters ({scale})",
            f"grid       {grid.describe()} = {grid.world_size} ranks{note}",
            f"batch      global_batch={train.global_batch} = micro_batch={train.micro_batch}{how}"
            f" x grid.data={grid.data} x {train.accumulation_steps(grid)} micro-step(s)",
            f"nodes      {resolved.nodes} x {resolved.tasks_per_node} tasks",
            f"memory     {mem}",
            f"preflight  {preflight_words(cfg)}",
            f"job dir    {job_dir}",
        ]
    )


def preflight_words(cfg: LaunchConfig) -> str:
    if not preflight_on(cfg):
        return "off" + ("" if cfg.preflight is False else " (preflight=true runs it)")
    ex = cfg.machine.preflight_expectations()
    floor = f" or {ex.gemm_min_tflops:.3g} TFLOP/s" if ex.gemm_min_tflops else ""
    bandwidth = (
        f"warn below {ex.intra_node_min_gbps:.3g}/{ex.inter_node_min_gbps:.3g} GB/s inside/across"
        " nodes"
        if ex.intra_node_min_gbps or ex.inter_node_min_gbps
        else "logged"
    )
    network = f"; network /{ex.network}/ across nodes" if ex.network else ""
    return (
        f"on: a rank below {ex.slow_fraction:g} x the median GEMM rate{floor} is slow"
        f" ({ex.on_slow}); all-reduce bandwidth {bandwidth}{network}"
    )


def planner_note(pick: int) -> str:
    """grid.pick=k takes the planner's (k+1)-th best grid."""
    return " (planner's best)" if pick == 0 else f" (planner's choice {pick + 1})"


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
        # what submitit.SlurmJob(folder, job_id, tasks=range(tasks)) needs to reattach
        "submitit": {
            "folder": str(slurm_folder(job_dir)),
            "tasks": resolved.nodes * resolved.tasks_per_node,
        },
    }


JOB_WRITTEN_KEYS = ("preflight", "slow_nodes")  # what the running job adds to job.json


def write_record(job_dir: Path, record: dict, **updates) -> dict:
    """The launcher's record, keeping what the job itself wrote into job.json for the same
    job id (its preflight verdict); another job's (a reused job dir) is dropped."""
    record.update(updates)
    with record_lock(job_dir):
        try:
            on_disk = json.loads((job_dir / "job.json").read_text())
        except (OSError, ValueError):
            on_disk = {}
        preflight = on_disk.get("preflight")
        job_id = current_job_id(record)
        if job_id and isinstance(preflight, dict) and preflight.get("job_id") == job_id:
            record.update({k: on_disk[k] for k in JOB_WRITTEN_KEYS if k in on_disk})
        write_record_file(job_dir, record)
    return record


def run_local(cfg: LaunchConfig, resolved: Resolved, job_dir: Path, record: dict) -> Outcome:
    procs = local.start_ranks(
        job_dir=job_dir, world_size=resolved.grid.world_size, env=dict(cfg.machine.env)
    )
    job_id = f"local-{procs[0].pid}"
    write_record(job_dir, record, job_ids=[job_id], status="running")
    log.info("started %s: %d local rank processes", job_id, len(procs))
    if cfg.wait is False:
        print(f"started {job_id}; job dir {job_dir}")
        return Outcome("submitted", str(job_dir), job_id, resolved.nodes)
    code = local.wait_ranks(procs)
    status = "completed" if code == 0 else "failed"
    log.info("%s %s (exit code %d)", job_id, status, code)
    if code:
        report_first_failure(job_dir)
    write_record(job_dir, record, status=status, exit_code=code)
    return Outcome(status, str(job_dir), job_id, resolved.nodes, f"exit code {code}")


def report_first_failure(job_dir: Path) -> None:
    """The failing rank's exception, printed last: after the other ranks' noise."""
    first = rankfail.first_failure(job_dir)
    if first is not None:
        log.error("%s", rankfail.headline(first))
        print(f"\n{rankfail.describe(first)}", file=sys.stderr, flush=True)


def refused(
    cfg: LaunchConfig, resolved: Resolved, job_dir: Path, record: dict, exc: Exception
) -> Outcome:
    """sbatch said no (or is missing): one line, and a job.json that says so."""
    lines = [ln.strip().removeprefix("sbatch: error: ") for ln in str(exc).splitlines()]
    why = "; ".join(ln for ln in lines if ln) or type(exc).__name__
    if isinstance(exc, OSError):
        why = f"cannot run sbatch ({why}); submit from a login node of {cfg.machine.name}"
    write_record(job_dir, record, status="refused", error=why)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise exc
    print(
        f"error: sbatch refused the job on {cfg.machine.name}: {why}; fix the machine.slurm.*"
        f" setting it names and launch again (recorded in {job_dir}/job.json)",
        file=sys.stderr,
    )
    return Outcome("refused", str(job_dir), nodes=resolved.nodes, message=why)


def submit_slurm(
    cfg: LaunchConfig, resolved: Resolved, job_dir: Path, record: dict, *, out
) -> Outcome:
    params = render.slurm_parameters(
        machine=cfg.machine,
        nodes=resolved.nodes,
        tasks_per_node=resolved.tasks_per_node,
        job_name=cfg.name,
    )
    from submitit.core.utils import FailedJobError

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit echoes sbatch's errors
            job = slurm.submit(
                folder=slurm_folder(job_dir),
                params=params,
                job=TrainJob(str(job_dir), cfg.machine.task_env),
                max_requeue=cfg.max_requeue,
                python=cfg.machine.task_python(sys.executable),
            )
    except (FailedJobError, OSError) as exc:
        return refused(cfg, resolved, job_dir, record, exc)
    write_record(job_dir, record, job_ids=[job.job_id], status="submitted")
    print(f"submitted job {job.job_id} ({resolved.nodes} nodes); job dir {job_dir}", file=out)
    log.info("submitted Slurm job %s (%d nodes)", job.job_id, resolved.nodes)
    if not cfg.wait:
        return Outcome("submitted", str(job_dir), job.job_id, resolved.nodes)
    state = slurm.follow(job, out=out)
    log.info("Slurm job %s ended %s", job.job_id, state)
    status = "completed" if state == "COMPLETED" else "failed"
    if status == "failed":
        report_first_failure(job_dir)
    write_record(job_dir, record, status=status, slurm_state=state)
    return Outcome(status, str(job_dir), job.job_id, resolved.nodes, state)
