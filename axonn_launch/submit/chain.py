"""Runs that heal themselves: when an attempt of a Slurm job fails, classify it and act on
its class, with no person in the loop. This module chains the recovery jobs, keeps the
run's record and stops a run; ``batch/recovery.py`` is the recovery step itself.

Each attempt is submitted with a recovery job chained to it (``sbatch
--dependency=afterany``), so recovery works under ``wait=false`` and after the login
session is gone. ``afterany``, not ``afternotok``: an allocation that lost its batch host
may end COMPLETED with training left, and Slurm cancels an ``afternotok`` job whose
dependency can never be met; the recovery step classifies every end itself (a finished
run is settled done). The root attempt's ``job.json`` holds the chain's state.

Why a Slurm job, why ``--no-requeue``, and local runs: ``docs/recovery.md``
("submit/chain.py").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from axonn_launch import scheduler
from axonn_launch.common import slurmtext
from axonn_launch.common.jobdir import (
    RECOVERY_LOG,
    JobPaths,
    job_lock,
    read_record,
    read_record_or_empty,
    record_lock,
    run_root,
    update_record,
    write_record_file,
)
from axonn_launch.config.compose import ConfigError, LaunchConfig, RecoveryConfig, build
from axonn_launch.records import failures, provenance
from axonn_launch.records.runs import USER_STOP
from axonn_launch.records.status import (
    RUN_DONE,
    RUN_RECOVERING,
    RUN_RUNNING,
    RUN_STOPPED,
    run_state,
)
from axonn_launch.scheduler import processes
from axonn_launch.scheduler.slurm import SLURM

RESUME, RESUME_EXCLUDE, STOP, ROLLBACK = (
    failures.RESUME, failures.RESUME_EXCLUDING, failures.STOP, failures.ROLLBACK,
)  # fmt: skip
POLICY_ACTIONS = (RESUME, RESUME_EXCLUDE, STOP, ROLLBACK)
# an action that only some classes take: rollback resumes from the newest checkpoint
# before a non-finite step and skips that step's batch (batch/recovery.py)
ACTION_CLASSES = {ROLLBACK: (failures.NON_FINITE,)}
# Resume what a fresh start cures; leave out the nodes that failed; never loop on a bug:
# the failure-class table's by_chain column (records/failures.py's RECOVERY).
DEFAULT_POLICY = dict(failures.CHAIN_POLICY)
FEWER_NODES = ("shrink", "wait", "stop")
MODES = ("auto", "on", "off")  # auto: Slurm only; on: local jobs too
RUNNING, RECOVERING, DONE, STOPPED = RUN_RUNNING, RUN_RECOVERING, RUN_DONE, RUN_STOPPED
RECOVERY_TIME_MIN = 10
NOTIFY_TIMEOUT_S = 60


# --- the settings -------------------------------------------------------------------------


def problem(settings: RecoveryConfig) -> str | None:
    """Why these recovery settings are invalid (one line), or None."""
    if settings.mode not in MODES:
        return f"recovery.mode={settings.mode!r}: valid: {', '.join(MODES)}"
    for name, action in settings.policy.items():
        if name not in DEFAULT_POLICY:
            return (
                f"recovery.policy.{name}: not a failure class; valid: {', '.join(DEFAULT_POLICY)}"
            )
        valid = [a for a in POLICY_ACTIONS if name in ACTION_CLASSES.get(a, (name,))]
        if action not in valid:
            only = [a for a in POLICY_ACTIONS if a not in valid and a == action]
            why = f" ({action} is only for {', '.join(ACTION_CLASSES[action])})" if only else ""
            return f"recovery.policy.{name}={action!r}: valid: {', '.join(valid)}{why}"
    for key in ("max_attempts", "max_same_class", "max_no_progress"):
        if getattr(settings, key) < 1:
            return f"recovery.{key}={getattr(settings, key)}: must be at least 1"
    for key in ("backoff_s", "budget_h"):
        if getattr(settings, key) < 0:
            return f"recovery.{key}={getattr(settings, key)}: must be 0 or more"
    if settings.on_fewer_nodes not in FEWER_NODES:
        return (
            f"recovery.on_fewer_nodes={settings.on_fewer_nodes!r}: valid: {', '.join(FEWER_NODES)}"
        )
    return None


def enabled(cfg: LaunchConfig) -> bool:
    """Slurm jobs recover unless ``recovery=off``; local jobs only with ``recovery=on``
    (their supervisor runs the recovery step); a rehearsal never (it runs once: its site's
    partitions do not exist here)."""
    if cfg.rehearse or cfg.recovery.mode == "off" or chain_forbidden(cfg):
        return False
    return cfg.recovery.mode == "on" or scheduler.of(cfg.machine).queued


def chain_forbidden(cfg: LaunchConfig) -> str:
    """The QOS or partition of a Slurm job on which its site forbids chained jobs ('')."""
    return cfg.machine.slurm.chain_forbidden_by() if scheduler.of(cfg.machine).queued else ""


def queue_rule_warnings(cfg: LaunchConfig) -> list[str]:
    """One line when the site's rules turn this job's recovery chain off."""
    forbidden = chain_forbidden(cfg)
    if not forbidden or cfg.rehearse or cfg.recovery.mode == "off":
        return []
    return [
        f"{cfg.machine.name} forbids chained jobs on {forbidden}, so no recovery job is"
        " chained to this one and a failure waits for `jobs resubmit`; source:"
        f" {cfg.machine.sources.get('slurm.no_chain', 'the machine profile')}"
    ]


def sweep_queue_warnings(cfg: LaunchConfig, points: int) -> list[str]:
    """One line when a sweep's jobs (each point's, and its recovery job) exceed the jobs
    one user may have queued on the site (``machine.slurm.max_queued_jobs``)."""
    limit = cfg.machine.slurm.max_queued_jobs
    per_point = 2 if enabled(cfg) and scheduler.of(cfg.machine).queued else 1
    if not scheduler.of(cfg.machine).queued or not limit or points * per_point <= limit:
        return []
    each = "a job and its recovery job" if per_point == 2 else "a job"
    return [
        f"{points} points x {each} = {points * per_point} queued jobs, over"
        f" machine.slurm.max_queued_jobs={limit}: sbatch refuses the jobs past the limit;"
        " split the sweep into runs of fewer points; source:"
        f" {cfg.machine.sources.get('slurm.max_queued_jobs', 'the machine profile')}"
    ]


def policy_of(settings: RecoveryConfig, failure: str) -> str:
    return failures.chain_action(failure, settings.policy)


def settings_of(record: dict) -> RecoveryConfig:
    return build(RecoveryConfig, dict(record.get("recovery") or {}), "recovery")


# --- chaining a recovery job to an attempt --------------------------------------------------


def attempt_parameters(cfg: LaunchConfig, params: dict) -> dict:
    """submitit's parameters for a chained attempt: not requeued by Slurm itself, so that
    a node failure ends it and its recovery job starts."""
    if not enabled(cfg):
        return params
    extra = {**params.get("additional_parameters", {}), "no-requeue": True}
    return {**params, "additional_parameters": extra}


def recovery_script(cfg: LaunchConfig, job_dir: Path) -> str:
    """The recovery job's batch script: one task that runs the recovery step."""
    slurm, paths = cfg.machine.slurm, JobPaths(job_dir)
    options = {
        "job-name": f"{cfg.name}-recovery",
        "nodes": "1",
        "ntasks": "1",
        "time": str(RECOVERY_TIME_MIN),
        "output": os.path.join(slurmtext.escape_percent(str(paths.logs)), RECOVERY_LOG),
        "partition": slurm.partition,
        "account": slurm.account,
        "qos": slurm.qos,
        "constraint": slurm.constraint,
    }
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH --{k}={shlex.quote(v)}" for k, v in options.items() if v]
    command = [sys.executable, "-m", "axonn_launch.recover", str(job_dir)]
    if provenance.snapshot_on(cfg):  # the next attempt is launched from the run's code
        lines.append(provenance.import_first(paths.code))
    lines.append("exec " + " ".join(shlex.quote(word) for word in command))
    return "\n".join(lines) + "\n"


def submit_recovery_job(cfg: LaunchConfig, job_dir: Path, job_id: str) -> str:
    """Submit the recovery job of attempt ``job_id``; its Slurm id ('' when sbatch said no,
    which is recorded: the attempt still runs, it only lacks its recovery)."""
    write_recovery_script(cfg, job_dir)
    return sbatch_recovery(job_dir, job_id)


def write_recovery_script(cfg: LaunchConfig, job_dir: Path) -> None:
    paths = JobPaths(job_dir)
    paths.logs.mkdir(parents=True, exist_ok=True)
    paths.recovery_script.write_text(recovery_script(cfg, job_dir))


DEPENDENCY = "afterany"  # whatever Slurm calls the end: the recovery step classifies it


def sbatch_recovery(job_dir: Path, job_id: str) -> str:
    """Submit the job dir's recovery script, to start once job ``job_id`` ended, however
    it ended; its id, or '' (recorded as ``recovery_error``) when sbatch said no."""
    options = (f"--dependency={DEPENDENCY}:{job_id}", "--kill-on-invalid-dep=yes")
    found, error = SLURM.submit_script(JobPaths(job_dir).recovery_script, *options)
    if error:
        update_record(job_dir, recovery_error=error)
    return found


# --- the chain's record (in the run's root dir) ----------------------------------------------


def chain_of(root: Path) -> dict:
    return dict(read_record_or_empty(root).get("chain") or {})


def set_chain(root: Path, settings: RecoveryConfig, **updates) -> dict:
    """Update the chain record; a new state is announced to ``recovery.notify``."""
    with record_lock(root):
        record = read_record(root)
        before = dict(record.get("chain") or {})
        record["chain"] = {**before, **updates, "updated_at": time.time()}
        write_record_file(root, record)
    if "state" in updates and updates["state"] != before.get("state"):
        notify(settings, root, updates["state"])
    return record["chain"]


def notify(settings: RecoveryConfig, root: Path, state: str) -> None:
    """Run the user's command with the run dir and the new state; its failure is logged in
    the chain record, never raised (a broken notifier must not stop a recovery)."""
    if not settings.notify:
        return
    try:
        subprocess.run([*shlex.split(settings.notify), str(root), state],
                       timeout=NOTIFY_TIMEOUT_S, check=True, capture_output=True)  # fmt: skip
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        update_record(root, notify_error=f"{settings.notify}: {exc}")


# --- following and stopping a chain ---------------------------------------------------------


def follow(root: Path, out, poll_s: float = 1.0) -> str:
    """Wait until the run is done or stopped (a launch with wait=true); its final state.
    Each poll reads two small JSON files: 1 s costs nothing, 5 s kept a waited run's
    launcher up to 5 s after its end."""
    shown = ""
    while True:
        state = run_state(root)
        if state != shown:
            print(f"recovery: {state}", file=out, flush=True)
            shown = state
        if state in (DONE, STOPPED):
            return state
        time.sleep(poll_s)


def settle_done(root: Path) -> bool:
    """Record that a run whose newest attempt finished its training is done (announced to
    ``recovery.notify``): no recovery step runs after a success, so chain.state would
    keep the "running" of the attempt that succeeded. True when it was settled now."""
    record = read_record_or_empty(root)
    said = (record.get("chain") or {}).get("state", RUNNING)
    recovers = bool(record.get("chain")) or "recovery" in record
    if not recovers or said not in (RUNNING, RECOVERING) or run_state(root, record) != DONE:
        return False
    set_chain(root, settings_of(record), state=DONE)
    return True


def attempts_of(root: Path) -> list[Path]:
    """The run's attempt dirs in order, following each ``resubmitted_as``."""
    chain, seen = [Path(root)], {str(root)}
    while True:
        nxt = read_record_or_empty(chain[-1]).get("resubmitted_as")
        if not nxt or nxt in seen:
            return chain
        chain.append(Path(nxt))
        seen.add(nxt)


class NotOurJob(ValueError):
    """A recorded Slurm job that is not this job dir's (a copied or edited job.json names
    someone else's job): nothing is cancelled. The message names the job and what differs."""


def stop(job_dir: Path) -> str:
    """End the run cleanly: mark it stopped (a recovery step that starts now does nothing),
    then cancel its newest attempt's jobs and recovery job, once Slurm has confirmed that
    each is that attempt's (``check_ours``; NotOurJob before anything is written)."""
    job_dir = Path(job_dir).resolve()
    root = run_root(job_dir, read_record(job_dir))
    settings = settings_of(read_record(root))
    with newest_attempt_locked(root) as newest:  # a resubmission of it waits, or is waited for
        wanted = slurm_jobs_of(read_record_or_empty(newest))
        ids = check_ours(newest, wanted)
        why = {"reason": USER_STOP, "class": ""}
        # stopped_by_user stays when the attempt's supervisor records its own stop after this
        set_chain(root, settings, state=STOPPED, stop=why, stopped_by_user=True)
        SLURM.cancel(ids)
        stopped = stop_local_attempt(newest)
    ids += [f"local-{pid}" for pid in stopped]
    return f"stopped {root}" + (f": cancelled {' '.join(ids)}" if ids else "")


@contextlib.contextmanager
def newest_attempt_locked(root: Path) -> Iterator[Path]:
    """The run's newest launched attempt, held under its ``job_lock``: the lock a
    resubmission of it holds while it launches. A resubmission under way ends first (and
    its new attempt is the one given); one that starts later sees what was done here."""
    while True:
        newest = launched_attempts(root)[-1]
        with job_lock(newest):
            if launched_attempts(root)[-1] == newest:
                yield newest
                return


def launched_attempts(root: Path) -> list[Path]:
    """``attempts_of`` up to the newest whose job.json exists (a resubmission writes the
    mark before its attempt's record)."""
    found = attempts_of(root)
    while len(found) > 1 and not JobPaths(found[-1]).record.is_file():
        found.pop()
    return found


def slurm_jobs_of(record: dict) -> dict[str, str]:
    """The Slurm jobs an attempt's job.json names, by id: the Slurm job name each was
    given (the attempt's ``name``; its recovery job's ``<name>-recovery``)."""
    name = str(record.get("name", ""))
    wanted = {str(i): name for i in record.get("job_ids") or [] if not str(i).startswith("local-")}
    if record.get("recovery_job"):
        wanted[str(record["recovery_job"])] = f"{name}-recovery"
    return wanted


def check_ours(job_dir: Path, wanted: dict[str, str]) -> list[str]:
    """The ids of ``wanted`` (id -> job name) still queued or running, once squeue says each
    is this dir's: its name, and an output path inside ``job_dir`` (where the launcher and
    ``recovery_script`` send it). Raises NotOurJob naming the job and what differs, or
    when squeue cannot tell; ended jobs are left out (nothing to cancel)."""
    if not wanted:
        return []
    owners, said = SLURM.owners()
    if owners is None:
        raise NotOurJob(f"cannot check jobs {' '.join(wanted)}: {said}; nothing cancelled")
    live = [job_id for job_id in wanted if job_id in owners]
    for job_id in live:
        why = ownership_problem(job_dir, wanted[job_id], *owners[job_id])
        if why:
            raise NotOurJob(f"job {job_id} is not {job_dir}'s: {why}; nothing cancelled")
    return live


def ownership_problem(job_dir: Path, name: str, found_name: str, stdout: str) -> str:
    """What differs between the job Slurm knows (``found_name``, its ``stdout`` pattern)
    and the one ``job_dir`` launched as ``name`` ('' when nothing does)."""
    differs = []
    if found_name != name:
        differs.append(f"its name is {found_name!r}, not {name!r}")
    where = os.path.realpath(stdout.replace("%%", "%")) if stdout else ""
    if not where.startswith(os.path.realpath(job_dir) + os.sep):
        differs.append(f"its output goes to {stdout or '(none)'}, outside this dir")
    return " and ".join(differs)


def stop_local_attempt(job_dir: Path) -> list[int]:
    """SIGTERM to a running local attempt's supervisor: it stops the ranks, records the
    end and, stopped by a signal, recovers nothing. The pids it was sent to."""
    return processes.signal_supervisors([job_dir], signal.SIGTERM)


def settings_problem(cfg: LaunchConfig) -> None:
    """The login node's check of ``recovery.*`` (raises ConfigError)."""
    why = problem(cfg.recovery)
    if why:
        raise ConfigError(why)


def record_fields(cfg: LaunchConfig) -> dict:
    """What an attempt's job.json keeps of the recovery settings."""
    return {"recovery": dataclasses.asdict(cfg.recovery)} if enabled(cfg) else {}
