"""compose -> validate -> plan -> render -> submit, for one configuration.

Never imports torch: this runs on login nodes.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from axonn_launch import scheduler
from axonn_launch.common.jobdir import (
    RECORD_TIME,
    JobPaths,
    last_job_id,
    read_record_or_empty,
    record_lock,
    remove_interrupted_saves,
    run_root,
    write_record_file,
)
from axonn_launch.common.spec import JobSpec, RuntimeConfig
from axonn_launch.config.compose import ConfigError, LaunchConfig, site_record, yaml_text
from axonn_launch.config.resolve import Resolved, check_job_dir, container_warnings, resolve
from axonn_launch.records import failures, firstfail, provenance
from axonn_launch.scheduler import processes, slurm_jobs
from axonn_launch.submit import (
    allocation,
    chain,
    dirguard,
    dirlock,
    duplicates,
    in_job,
    pack,
    rank_rehearsal,
    rehearse,
    render,
)
from axonn_launch.submit.summary import (
    command_path,
    dry_run_text,
    headroom_warnings,
    next_line,
    predicted_step_s,
    preflight_on,
    summary,
    wallclock_warnings,
)
from axonn_launch.submit.task import TrainJob

EXIT_OK, EXIT_JOB_FAILED, EXIT_BAD_INPUT = 0, 1, 2
# Ctrl-C while waiting (a detach from a Slurm job, a stop of a local one): 128 + SIGINT, as
# a shell says it, so that ``launch wait=true && next`` never takes it for a finished job
EXIT_INTERRUPTED = 130

# The console gets print(); the job dir's axonn_launch.log (Hydra's file handler) gets log.
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    # dry_run | submitted | completed | failed | invalid | refused (by sbatch)
    # | interrupted (Ctrl-C: a Slurm job followed no more, or stopped; a local job stopped)
    status: str
    job_dir: str
    job_id: str = ""
    nodes: int = 0
    message: str = ""

    @property
    def exit_code(self) -> int:
        if self.status == "invalid":
            return EXIT_BAD_INPUT
        if self.status == "interrupted":
            return EXIT_INTERRUPTED
        return EXIT_JOB_FAILED if self.status in ("failed", "refused") else EXIT_OK


@dataclass(frozen=True)
class Checked:
    """A launch's checks, each run once (``check``), and what they found: the config as
    the user gave it (a rehearsal's site's own), its one resolution (of ``resolved.cfg``:
    a rehearsal's site config), the rehearsal, the held allocation, and warnings."""

    cfg: LaunchConfig
    resolved: Resolved
    rehearsal: rehearse.Rehearsal | None
    held: allocation.Held | None
    warnings: list[str]


def check(cfg: LaunchConfig, job_dir: str) -> Checked:
    """Every launch-time check of ``cfg`` into ``job_dir``, once, before anything is
    written (``cli.ValidateRun`` for a run, ``cli.run_checks`` for a sweep point):
    raises ConfigError, one line."""
    rehearsal = rehearse.prepare(cfg, job_dir) if cfg.rehearse else None
    resolved = resolve(cfg)
    rank_rehearsal.check_rank(cfg, resolved)  # rehearse=rank: a rank of this job
    checked = resolved.cfg
    check_job_dir(job_dir, checked.machine)
    require_scheduler(checked)  # a submission with no Slurm here: one line
    held = allocation.check_fits(checked, resolved.nodes, resolved.tasks_per_node)
    pack.check(checked, resolved.nodes)
    warnings = container_warnings(checked, job_dir)
    return Checked(
        cfg, resolved, rehearsal, held, warnings + (rehearsal.warnings if rehearsal else [])
    )


def require_scheduler(cfg: LaunchConfig) -> None:
    """A submission needs its scheduler's commands here (a laptop has no Slurm): raises
    ConfigError, one line naming what is missing and what runs without them. A dry run
    submits nothing; a rehearsal says the same of the local cluster (``rehearse.py``)."""
    why = (
        ""
        if cfg.dry_run or cfg.rehearse
        else scheduler.of(cfg.machine).unavailable(cfg.machine.name)
    )
    if why:
        raise ConfigError(why)


def check_run(tree: Any, cfg: LaunchConfig, run_dir: str) -> Checked:
    """Check a run and resolve it, once (``pipeline.check``), and the recovery settings.
    A study's data (``+study=...``) is prepared first (``prepare_study``)."""
    if "study" in tree:
        prepare_study(tree, cfg)
    checked = check(cfg, run_dir)
    chain.settings_problem(checked.resolved.cfg)
    in_job.check(checked.resolved.cfg)
    return checked


def study_callback(tree: Any) -> Any:
    """The study's Hydra callback (``submit/study_data.PrepareStudy``), which checks its
    settings as it is made: a bad one is one line here."""
    from axonn_launch.submit.study_data import PrepareStudy, StudyError

    try:
        return PrepareStudy(tree.study)
    except StudyError as exc:
        raise ConfigError(str(exc)) from None


def prepare_study(tree: Any, cfg: LaunchConfig) -> None:
    """A study's data is prepared by its Hydra callback when the run starts, after the
    check of ``train.data``; so once the rest is valid (checked as a dry run, which only
    warns about missing data) it is prepared here. The run is then resolved again, with
    its data: a study run resolves twice."""
    from axonn_launch.submit.study_data import StudyError

    resolve(replace(cfg, dry_run=True))
    try:
        study_callback(tree).ensure()
    except StudyError as exc:
        raise ConfigError(str(exc)) from None


def launch(
    checked: Checked,
    *,
    job_dir: Path,
    config: dict,
    command_line: list[str],
    out=sys.stdout,
    record_extra: dict | None = None,
) -> Outcome:
    """Write the job directory, then dry-run, run locally or submit the run ``checked``
    holds (``check``: its checks, run once before). ``record_extra``: more of job.json
    from the start (a resubmission's attempt, lineage)."""
    job_dir = job_dir.resolve()
    resolved, rehearsal, held = checked.resolved, checked.rehearsal, checked.held
    to_run = rehearse.as_run(resolved.cfg, rehearsal) if rehearsal else resolved.cfg
    if held:  # a step of the held allocation: it never chains a recovery job
        to_run = replace(to_run, recovery=replace(to_run.recovery, mode="off"))
    config_yaml = resolved_yaml(config, resolved)  # the job dir's config.yaml
    if not (record_extra or {}).get("parent"):  # a new attempt continues its own run
        duplicates.refuse_duplicate(to_run, config_yaml, job_dir)
    warnings = wallclock_warnings(to_run, resolved) + headroom_warnings(to_run, resolved)
    warnings += checked.warnings + chain.queue_rule_warnings(to_run)
    for warning in resolved.warnings + warnings:
        print(f"warning: {warning}", file=sys.stderr)
        log.warning(warning)
    batch = slurm_batch(to_run, resolved, job_dir, rehearsal)
    with dirguard.claimed(job_dir) as claim:  # one launch at a time; it makes the dir
        run = Launch(to_run, checked.cfg, resolved, rehearsal, claim, batch, held)
        return claimed_launch(run, job_dir, config_yaml, command_line, out, record_extra or {})


def claimed_launch(
    run: Launch, job_dir: Path, config_yaml: str, command_line: list[str], out, record_extra: dict
) -> Outcome:
    """In the claimed job dir: a new attempt of its run (resume=true) when asked, undone
    when nothing started."""
    continued = dirguard.continuation(job_dir, run.cfg.dry_run)  # resume=true's attempt
    outcome = None
    try:
        outcome = write_and_start(
            run, job_dir, config_yaml, command_line, out, {**continued, **record_extra}
        )
    finally:
        if continued and (outcome is None or outcome.status == "refused"):
            dirguard.undo_continuation(job_dir, continued)
    return outcome


@dataclass(frozen=True)
class SlurmBatch:
    """What submitit gets for a Slurm job, made once per launch: its parameters (a
    rehearsal's substituted) and the interpreter its tasks run (a node-local copy's with
    ``machine.python_broadcast``)."""

    params: dict
    python: str
    folder: Path
    restarts: render.InPlace | None = None  # the training step's restarts in place

    def script(self) -> str:
        return render.script_of(
            self.params, folder=self.folder, python=self.python, restarts=self.restarts
        )


@dataclass(frozen=True)
class Launch:
    """What ``launch`` checked and holds: the config to run (a rehearsal's substitution),
    the site's own, their resolution, the rehearsal, the job dir's lock and, on Slurm,
    the batch."""

    cfg: LaunchConfig
    site_cfg: LaunchConfig
    resolved: Resolved
    rehearsal: rehearse.Rehearsal | None
    claim: dirlock.Claim
    batch: SlurmBatch | None = None
    held: allocation.Held | None = None  # the Slurm allocation it runs inside (salloc)


def write_and_start(
    run: Launch,
    job_dir: Path,
    config_yaml: str,
    command_line: list[str],
    out,
    record_extra: dict,
) -> Outcome:
    """Write the job directory (``config_yaml``: its config.yaml, ``resolved_yaml``), then
    dry-run, run locally or submit."""
    cfg, site_cfg, resolved, rehearsal = run.cfg, run.site_cfg, run.resolved, run.rehearsal
    spec = job_spec(cfg, resolved, job_dir)
    spec.save(JobPaths(job_dir).spec)
    write_preflight_expectations(cfg, job_dir)
    JobPaths(job_dir).config.write_text(config_yaml)
    script = run.batch.script() if run.batch else ""
    if script:
        JobPaths(job_dir).submission.write_text(script)
    if rehearsal:
        JobPaths(job_dir).site_submission.write_text(
            batch_script(site_cfg, resolved, job_dir, None)
        )
    record = {**job_record(cfg, resolved, job_dir, command_line), **record_extra}
    # what runs: versions, revision, the installed distributions, the snapshot it imports
    record["provenance"] = provenance.record(
        job_dir, snapshot=provenance.snapshot_on(cfg), dry_run=cfg.dry_run
    )
    if rehearsal:
        record.update(rehearsal.record())
    report = summary(cfg, resolved, job_dir)
    if rehearsal:
        report += "\n" + rehearsal.describe()
    if run.held:
        report += "\n" + run.held.line(run.batch.params)
    print(report, file=out)
    log.info("%s\n%s", "dry run: nothing is started" if cfg.dry_run else "launching", report)
    if cfg.dry_run:
        command = local_command_text(cfg, resolved, job_dir)
        print(dry_run_text(cfg, config_yaml, script, command), file=out)
        write_record(job_dir, record, status="dry_run")
        if pack.packed(cfg):
            register_packed(run, job_dir, script)
        return Outcome("dry_run", str(job_dir), nodes=resolved.nodes)
    if pack.packed(cfg):
        return wait_for_pack(run, job_dir, record, script, out=out)
    start = run_in_allocation if run.held else STARTERS[scheduler.of(cfg.machine).queued]
    return start(run, job_dir, record, out=out)


def register_packed(run: Launch, job_dir: Path, script: str, recovery: bool = False) -> None:
    """A packed sweep's point joins the sweep's pending points (``submit/pack.py``)."""
    resolved = run.resolved
    point = pack.point_of(run.cfg, job_dir, resolved.nodes, resolved.tasks_per_node,
                          script, run.batch.params, recovery=recovery)  # fmt: skip
    pack.register(point, pack.sweep_point()[0])


def wait_for_pack(run: Launch, job_dir: Path, record: dict, script: str, *, out) -> Outcome:
    """A packed point: its job pickled for its pack's run (``batch/pack_runner.py``), then it
    waits to be packed and submitted when the sweep has seen every point. A job array's
    task is a job of its own: its recovery job is written now, chained once submitted."""
    from submitit.core.utils import DelayedSubmission

    chained = pack.width_of(run.cfg) == pack.ARRAY and chain.enabled(run.cfg)
    if chained:
        chain.write_recovery_script(run.cfg, job_dir)
    job = TrainJob(str(job_dir), run.cfg.machine.task_env, chained=chained)
    DelayedSubmission(job).dump(JobPaths(job_dir).pack_submission)
    write_record(job_dir, record, status="packed")
    register_packed(run, job_dir, script, recovery=chained)
    print(f"packed: submitted in a pack at the end of the sweep; job dir {job_dir}", file=out)
    return Outcome("packed", str(job_dir), nodes=run.resolved.nodes)


def resolved_yaml(config: dict, resolved: Resolved) -> str:
    """The composed config with what validation fixed: grid, nodes, planner's micro-batch,
    the checkpoint interval. The text ``OmegaConf.to_yaml`` gives (``yaml_text``)."""
    config = dict(config)
    config["grid"] = {**resolved.grid.as_dict(), "auto": resolved.planned}
    config["nodes"] = resolved.nodes
    config["train"] = {
        **config.get("train", {}),
        "micro_batch": resolved.train.micro_batch,
        "cache_layers": resolved.train.cache_layers,
        # auto's interval (cost/expected_goodput.py)
        "checkpoint_every": resolved.train.checkpoint_every,
    }
    return yaml_text(config)


def write_preflight_expectations(cfg: LaunchConfig, job_dir: Path) -> None:
    """What the job's preflight compares with, from the machine profile (or nothing)."""
    path = JobPaths(job_dir).preflight_expected
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
        metrics=cfg.metrics,
    )


def batch_script(
    cfg: LaunchConfig,
    resolved: Resolved,
    job_dir: Path,
    rehearsal: rehearse.Rehearsal | None = None,
) -> str:
    """The batch script; a rehearsal's has the site-only parts substituted."""
    batch = slurm_batch(cfg, resolved, job_dir, rehearsal)
    return batch.script() if batch else ""


def slurm_batch(
    cfg: LaunchConfig,
    resolved: Resolved,
    job_dir: Path,
    rehearsal: rehearse.Rehearsal | None,
) -> SlurmBatch | None:
    """submitit's parameters (the machine's, or a rehearsal's substitution of them) and the
    tasks' interpreter, with the node-local copy of the environment worked out once;
    None off Slurm."""
    if not scheduler.of(cfg.machine).queued:
        return None
    folder = slurm_folder(job_dir)
    copy = render.python_copy(
        cfg.machine,
        nodes=resolved.nodes,
        python=cfg.machine.task_python(sys.executable),  # a container machine names its own
        folder=folder,
    )
    restarts = in_job.in_place(cfg, resolved, job_dir, sys.executable)
    params = render.slurm_parameters(
        machine=cfg.machine,
        nodes=resolved.nodes + in_job.spares(cfg),
        tasks_per_node=resolved.tasks_per_node,
        job_name=cfg.name,
        copy=copy,
        code=str(JobPaths(job_dir).code) if provenance.snapshot_on(cfg) else "",
    )
    if rehearsal is None:
        params = in_job.job_parameters(cfg, chain.attempt_parameters(cfg, params))
    else:
        params = rehearse.substitute(params, rehearsal, cfg.machine, resolved.tasks_per_node)
    python = render.tasks_python(cfg.machine, sys.executable, copy)
    return SlurmBatch(params=params, python=python, folder=folder, restarts=restarts)


def slurm_folder(job_dir: Path) -> Path:
    return JobPaths(job_dir).slurm_job()


def local_command_text(cfg: LaunchConfig, resolved: Resolved, job_dir: Path) -> str:
    """How the ranks of a job that is no batch script start, in the scheduler's words."""
    command = [sys.executable, "-m", "axonn_launch.train", str(job_dir)]
    return scheduler.of(cfg.machine).run_text(command, resolved.grid.world_size)


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
        "submit_time": time.strftime(RECORD_TIME),
        "attempt": 1,
        "lineage": [],
        "command_line": command_line,
        "site_dir": site_record(),  # AXONN_SITE_DIR: a resubmission composes with it
        "dry_run": cfg.dry_run,
        "predicted_step_s": predicted_step_s(cfg, resolved),  # None: no honest prediction
        "partition": cfg.machine.slurm.partition,
        "submitted_at": time.time(),
        **chain.record_fields(cfg),
        **in_job.record_fields(cfg, resolved),
        # what submitit.SlurmJob(folder, job_id, tasks=range(tasks)) needs to reattach
        "submitit": {
            "folder": str(slurm_folder(job_dir)),
            "tasks": resolved.nodes * resolved.tasks_per_node,
        },
    }


JOB_WRITTEN_KEYS = ("preflight", "slow_nodes")  # what the running job adds to job.json
FINAL_STATUSES = ("completed", "failed")  # written once the job's ranks have all ended


def write_record(job_dir: Path, record: dict, **updates) -> dict:
    """The launcher's record, keeping what the job itself wrote into job.json for the same
    job id (its preflight verdict); another job's (a reused job dir) is dropped.

    Never raises OSError: a record that cannot be written (a full disk) is reported in one
    line (``record_write_failed``), and a final one is retried."""
    record.update(updates)
    try:
        _write_record(job_dir, record)
    except OSError as error:
        record_write_failed(job_dir, record, error)
    return record


def record_write_failed(job_dir: Path, record: dict, error: OSError) -> None:
    """One line naming job.json and the error. A failed job's record gets the storage
    class (``failure``, and ``record_error`` for ``jobs status``); a final record is
    written once more (``retry_final_record``)."""
    path = JobPaths(job_dir).record
    said = f"[Errno {error.errno}] {error.strerror}" if error.errno else str(error)
    failure = failures.storage_failure(error)
    if failure:  # the job dir's log file fails alike: no logging tracebacks on the console
        logging.raiseExceptions = False
    status = record.get("status")
    if status == "failed" and failure:
        record.update(failure=failure, record_error=f"{path}: {said}")
    freed = retry_final_record(job_dir, record) if status in FINAL_STATUSES else None
    if freed is not None:
        line = f"error: writing {path} failed once ({said}); written{freed}: {status}"
    else:
        old = read_record_or_empty(job_dir).get("status")
        says = f"it still says {old}" if old else "there is none"
        line = f"error: cannot write {path} ({said}): {says}, not {status}"
    if failure and status == "failed":
        line += f" ({failure}: see python -m axonn_launch.jobs status {job_dir})"
    print(line, file=sys.stderr, flush=True)
    log.error("%s", line)


def retry_final_record(job_dir: Path, record: dict) -> str | None:
    """Write a final record again, after removing the leftovers of an interrupted checkpoint
    save: no rank runs any more, a resume would remove them anyway, and on a full disk they
    are the room. What was freed, as words for the line; None when the write fails again."""
    removed = remove_interrupted_saves(job_dir)
    try:
        _write_record(job_dir, record)
    except OSError:
        return None
    return f" after removing {removed} interrupted checkpoint save(s)" if removed else ""


def _write_record(job_dir: Path, record: dict) -> None:
    with record_lock(job_dir):
        on_disk = read_record_or_empty(job_dir)
        preflight = on_disk.get("preflight")
        job_id = last_job_id(record)
        if job_id and isinstance(preflight, dict) and preflight.get("job_id") == job_id:
            record.update({k: on_disk[k] for k in JOB_WRITTEN_KEYS if k in on_disk})
        write_record_file(job_dir, record)


def run_local(
    cfg: LaunchConfig, resolved: Resolved, job_dir: Path, record: dict, claim: dirlock.Claim
) -> Outcome:
    """Start the job's supervisor (``batch/supervise.py``), which owns the ranks and writes
    job.json's final state; with ``wait``, follow it, passing SIGINT, SIGTERM and SIGHUP
    on to it (it stops the ranks). With recovery on, a failed job's supervisor starts the
    next attempt: ``wait`` then follows the run to its end, passing those signals on to
    the supervisors of its attempts, and the outcome is the run's. The job dir's lock goes
    to the supervisor as it is released."""
    world_size = resolved.grid.world_size
    detached = cfg.wait is False
    print(processes.starting_line(world_size, detached=detached), flush=True)
    supervisor = processes.start_supervisor(
        job_dir=job_dir,
        world_size=world_size,
        env=dict(cfg.machine.env),
        console=detached_console(job_dir) if detached else None,
    )
    job_id = f"local-{supervisor.pid}"
    with contextlib.nullcontext() if detached else processes.passing_stop_signals(supervisor):
        write_record(job_dir, record, job_ids=[job_id], status="running")
        claim.name(f"local job {job_id} (pid {supervisor.pid} on {socket.gethostname()})", job_id)
        processes.release(supervisor)
        claim.release()  # the supervisor holds it from now on (supervise.py)
        log.info("started %s: %d local rank processes", job_id, world_size)
        if detached:
            print(f"started {job_id}; job dir {job_dir}\n{next_line(job_dir, ran=False)}")
            return Outcome("submitted", str(job_dir), job_id, resolved.nodes)
        code = processes.wait_supervisor(supervisor)
    status = final_local_status(job_dir, record, code)
    log.info("%s %s (exit code %d)", job_id, status, code)
    saved = stopped_by_user(record)
    if saved is not None:  # Ctrl-C: saved and stopped, never resumed by itself
        print(resume_line(job_dir, saved))
        return Outcome("interrupted", str(job_dir), job_id, resolved.nodes, f"saved step {saved}")
    if code:
        report_first_failure(job_dir)
    message = f"exit code {code}"
    root = run_root(job_dir, record)
    if status == "failed" and chain.enabled(cfg) and chain.chain_of(root):
        state = follow_local_run(job_dir, root)
        status, message = ("completed" if state == chain.DONE else "failed"), f"run {state}"
    print(next_line(job_dir, ran=True))
    return Outcome(status, str(job_dir), job_id, resolved.nodes, message)


def stopped_by_user(record: dict) -> int | None:
    """The step a local job saved before it stopped on a Ctrl-C (its supervisor's
    ``ended_by``), or None."""
    ended_by = record.get("ended_by")
    if isinstance(ended_by, dict) and ended_by.get("by_user"):
        return int(ended_by.get("saved_step", 0))
    return None


def resume_line(job_dir: Path, step: int) -> str:
    """The command that resumes a job stopped by the user from its saved step."""
    return f"next: {jobs_command('resubmit', job_dir)}  (resumes from step {step})"


def follow_local_run(job_dir: Path, root: Path) -> str:
    """Follow a local run with recovery on, which its supervisors carry on (the chain is
    recorded: this attempt's supervisor ran the recovery step), to its end; its state."""
    with processes.passing_stop_signals_to_run(lambda: chain.attempts_of(root)):
        state = chain.follow(root, sys.stdout)
    newest = chain.attempts_of(root)[-1].resolve()
    if state != chain.DONE and newest != job_dir:
        report_first_failure(newest)  # this attempt's was reported as it ended
    return state


def final_local_status(job_dir: Path, record: dict, code: int) -> str:
    """job.json's final status, as the supervisor wrote it; written here from its exit
    code if it could not (it was killed)."""
    on_disk = read_record_or_empty(job_dir)
    if (
        last_job_id(on_disk) == last_job_id(record)
        and on_disk.get("status") in processes.FINAL_STATES
    ):
        record.update(on_disk)
        return str(on_disk["status"])
    status = "completed" if code == 0 else "failed"
    write_record(job_dir, record, status=status, exit_code=code)
    return status


def detached_console(job_dir: Path) -> Path:
    """Where a detached local job's console goes (its supervisor's lines, rank 0's output):
    the launch's own log (Hydra's ``<job dir>/axonn_launch.log``), else rank 0's log."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return JobPaths(job_dir).rank_log(0)


def report_first_failure(job_dir: Path) -> None:
    """The failing rank's exception, printed last: after the other ranks' noise."""
    first = firstfail.first_failure(job_dir)
    if first is not None:
        log.error("%s", firstfail.headline(first))
        print(f"\n{firstfail.describe(first)}", file=sys.stderr, flush=True)


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
        f" setting it names and launch again (recorded in {JobPaths(job_dir).record})",
        file=sys.stderr,
    )
    return Outcome("refused", str(job_dir), nodes=resolved.nodes, message=why)


def submit_slurm(run: Launch, job_dir: Path, record: dict, *, out) -> Outcome:
    """Submit ``run.batch`` with sbatch; with ``wait``, follow the job to its end."""
    cfg, resolved, batch, claim = run.cfg, run.resolved, run.batch, run.claim
    from submitit.core.utils import FailedJobError

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit echoes sbatch's errors
            job = slurm_jobs.submit(
                folder=batch.folder,
                params=batch.params,
                job=TrainJob(str(job_dir), cfg.machine.task_env, chained=chain.enabled(cfg)),
                max_requeue=cfg.max_requeue,
                python=batch.python,
                script=functools.partial(render.as_submitted, restarts=batch.restarts),
            )
    except (FailedJobError, OSError) as exc:
        return refused(cfg, resolved, job_dir, record, exc)
    write_record(job_dir, record, job_ids=[job.job_id], status="submitted")
    # the job outlives this process: its id, checked with squeue
    claim.name(f"Slurm job {job.job_id}", job.job_id)
    nodes = f"{resolved.nodes} node" + ("s" if resolved.nodes != 1 else "")
    print(f"submitted job {job.job_id} ({nodes}); job dir {job_dir}", file=out)
    if chain.enabled(cfg):
        recovery_job = chain.submit_recovery_job(cfg, job_dir, job.job_id)
        write_record(job_dir, record, recovery_job=recovery_job)
        print(recovery_line(recovery_job, job.job_id), file=out)
    log.info("submitted Slurm job %s (%d nodes)", job.job_id, resolved.nodes)
    if not cfg.wait:
        print(next_line(job_dir, ran=False), file=out)
        return Outcome("submitted", str(job_dir), job.job_id, resolved.nodes)
    try:
        return follow_slurm_job(cfg, job, job_dir, record, resolved.nodes, out)
    except KeyboardInterrupt:  # Ctrl-C: stop following; the job goes on
        return detach(job.job_id, job_dir, resolved.nodes, out)


def follow_slurm_job(
    cfg: LaunchConfig, job, job_dir: Path, record: dict, nodes: int, out
) -> Outcome:
    """Stream the job to its end (and its run's, with recovery on); the outcome."""
    state = slurm_jobs.follow(job, out=out)
    log.info("Slurm job %s ended %s", job.job_id, state)
    status = "completed" if state == "COMPLETED" else "failed"
    if status == "failed":
        report_first_failure(job_dir)
    write_record(job_dir, record, status=status, slurm_state=state)
    if status == "failed" and chain.enabled(cfg) and record.get("recovery_job"):
        status = "completed" if chain.follow(job_dir, out) == chain.DONE else "failed"
    print(next_line(job_dir, ran=True), file=out)
    return Outcome(status, str(job_dir), job.job_id, nodes, state)


def detach(job_id: str, job_dir: Path, nodes: int, out) -> Outcome:
    """A Ctrl-C while following a Slurm job: one line, and the job keeps running. A second
    Ctrl-C within ``slurm_jobs.SECOND_CTRL_C_S`` stops it as ``jobs stop`` does (its recovery
    job too), and says so in one more line; a third is ignored while that runs."""
    with slurm_jobs.SecondCtrlC() as second:
        status, stop = (jobs_command(verb, job_dir) for verb in ("status", "stop"))
        print(
            f"detached: job {job_id} keeps running; see it: {status}; stop it: {stop}"
            f" (or press Ctrl-C again within {slurm_jobs.SECOND_CTRL_C_S:.0f} s)",
            file=out,
            flush=True,
        )
        log.info("Ctrl-C: detached from Slurm job %s, which keeps running", job_id)
        if not second.within(slurm_jobs.SECOND_CTRL_C_S):
            return Outcome("interrupted", str(job_dir), job_id, nodes, "detached")
        try:
            said = chain.stop(job_dir)
        except chain.NotOurJob as error:  # squeue could not confirm the job is this dir's
            said = str(error)
    print(f"Ctrl-C again: {said}", file=out, flush=True)
    log.info("Ctrl-C again: %s", said)
    return Outcome("interrupted", str(job_dir), job_id, nodes, "stopped")


def jobs_command(verb: str, job_dir: Path) -> str:
    """``python -m axonn_launch.jobs VERB DIR``, to copy (this interpreter, the real dir)."""
    python, where = (shlex.quote(command_path(p)) for p in (sys.executable, str(job_dir)))
    return f"{python} -m axonn_launch.jobs {verb} {where}"


def recovery_line(recovery_job: str, job_id: str) -> str:
    if not recovery_job:
        return "recovery: sbatch refused the recovery job (job.json: recovery_error)"
    return (
        f"recovery: job {recovery_job} starts if job {job_id} fails, and resumes it"
        " (recovery=off submits no recovery job)"
    )


def run_in_allocation(run: Launch, job_dir: Path, record: dict, *, out) -> Outcome:
    """Run ``run.batch``'s script (submission.sh) as a step of the held allocation, in the
    foreground, never chained (``submit/allocation.py``)."""
    cfg, resolved, held = run.cfg, run.resolved, run.held
    write_record(job_dir, record, status="running", **allocation.step_record(held))
    run.claim.name(f"a step of Slurm job {held.job_id} (pid {os.getpid()})")
    log.info("running as a step of Slurm job %s (%d nodes)", held.job_id, resolved.nodes)
    try:
        code = allocation.run_step(
            script=JobPaths(job_dir).submission,
            folder=run.batch.folder,
            job=TrainJob(str(job_dir), cfg.machine.task_env),
            params=run.batch.params,
            allocation=held,
            out=out,
        )
    except KeyboardInterrupt:  # Ctrl-C: the ranks saved a checkpoint and ended
        write_record(job_dir, record, status="failed")
        print(f"stopped: {jobs_command('resubmit', job_dir)} resumes it", file=out)
        return Outcome("interrupted", str(job_dir), held.job_id, resolved.nodes, "stopped")
    status = "completed" if code == 0 else "failed"
    if code:
        report_first_failure(job_dir)
    write_record(job_dir, record, status=status, exit_code=code)
    log.info("step of Slurm job %s %s (exit code %d)", held.job_id, status, code)
    print(next_line(job_dir, ran=True), file=out)
    return Outcome(status, str(job_dir), held.job_id, resolved.nodes, f"exit code {code}")


def start_local(run: Launch, job_dir: Path, record: dict, *, out) -> Outcome:
    """Local ranks print to this terminal themselves; there is no site to rehearse."""
    return run_local(run.cfg, run.resolved, job_dir, record, run.claim)


# How a job starts, by its scheduler's kind (``scheduler/base.py``): a queued one's as a
# batch job through submitit, any other's as processes under a supervisor.
STARTERS: dict[bool, Callable[..., Outcome]] = {True: submit_slurm, False: start_local}
