"""Restarts in place, the decision (``python -m axonn_launch.restart <job_dir> <status>``),
run by a Slurm job's batch script after its training step failed and no signal caused it
(``render.restart_in_place``): classify the step, act on its class by the chain's policy,
leave out the failed nodes and take spares in their place, record the attempt in the run's
chain, and print the next step's srun options. With no spare left and
``recovery.on_fewer_nodes=shrink``, the grid shrinks in place: the chain's replanning
(``recovery.fewer_nodes_overrides``, the planner's grid for the nodes left) is composed here
and written into the job's spec.json, which the next step reads, resharding the checkpoint.
With no restart left, a class that does not resume, or too few nodes for any grid, the job
ends as its step did and the chain takes over.

What each step records: ``docs/recovery.md`` ("in place").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from axonn_launch.batch.recovery import (
    FAILURE_KEY,
    failure_key,
    fewer_nodes_overrides,
    limit_reached,
)
from axonn_launch.batch.resubmit import new_overrides, original_overrides
from axonn_launch.common import slurmtext
from axonn_launch.common.jobdir import (
    SLURM_RESULT,
    JobPaths,
    checkpointed_step,
    last_metrics,
    read_record,
    record_lock,
    run_root,
    write_record_file,
)
from axonn_launch.records import failures
from axonn_launch.records.evidence import (
    EndedStep,
    attempt_start,
    log_sizes,
    slurm_task_files,
    step_evidence,
)
from axonn_launch.scheduler.slurm import SLURM
from axonn_launch.submit import chain
from axonn_launch.submit.in_job import RECORD_KEY
from axonn_launch.submit.pack import NODES_VARIABLE

RESUMING = (chain.RESUME, chain.RESUME_EXCLUDE)


@dataclass(frozen=True)
class Decision:
    """The next step's nodes, or why the job ends (``stop``)."""

    nodes: tuple[str, ...] = ()
    tasks: int = 0
    stop: str = ""
    shrunk: dict | None = None  # the smaller grid the next step runs, with no spare left

    def srun_options(self) -> str:
        return f"--nodes={len(self.nodes)} --ntasks={self.tasks} --nodelist={','.join(self.nodes)}"


def decide(job_dir: Path, exit_status: int, environ: dict[str, str] | None = None) -> Decision:
    """After the training step of the job in ``job_dir`` failed with ``exit_status``."""
    environ = dict(os.environ if environ is None else environ)
    job_dir = Path(job_dir).resolve()
    record = read_record(job_dir)
    settings = record.get(RECORD_KEY)
    if not isinstance(settings, dict):
        return Decision(stop="no in-place restarts recorded for this job")
    ended = ended_step(job_dir, record, settings, exit_status, environ)
    diagnosis = failures.classify(step_evidence(job_dir, ended))
    action = dict(settings.get("policy") or {}).get(diagnosis.failure, chain.STOP)
    root = run_root(job_dir, record)
    why = stop_reason(root, settings, diagnosis.failure, action)
    attempt = attempt_of(job_dir, ended, diagnosis, action)
    attempt[FAILURE_KEY] = failure_key(ended.job_id, record)  # the recovery step's too
    history = [*chain.chain_of(root).get("attempts", []), attempt]
    started = float(record.get("submitted_at") or time.time())
    why = why or limit_reached(chain.settings_of(record), history, started)
    decision = Decision(stop=why)
    if not why:
        bad = diagnosis.bad_nodes if action == chain.RESUME_EXCLUDE else ()
        held = held_nodes(ended.job_id, environ)
        nodes, why = next_nodes(ended.nodes, held, bad, settings)
        tasks = len(nodes) * int(settings["tasks_per_node"])
        decision = Decision(nodes=nodes, tasks=tasks, stop=why)
        if why:
            decision = fewer_nodes(job_dir, record, usable(ended.nodes, held, bad), why)
    attempt["next_nodes"] = list(decision.nodes)
    if decision.shrunk:
        attempt["shrunk_to"] = decision.shrunk
    record_attempt(root, record, attempt, decision.stop)
    if not decision.stop:
        start_next_step(job_dir, ended.job_id, decision)
    return decision


def fewer_nodes(job_dir: Path, record: dict, good: tuple[str, ...], why: str) -> Decision:
    """Too few nodes left for the grid: a smaller grid on ``good`` when
    ``recovery.on_fewer_nodes=shrink`` (the chain's rule), else the job ends (``why``)."""
    settings = record[RECORD_KEY]
    overrides, stop = fewer_nodes_overrides(chain.settings_of(record), settings, [], list(good))
    if stop or not overrides:
        return Decision(stop=f"{why}{': ' + stop if stop else ''}")
    return shrink_in_place(job_dir, record, good, overrides, why)


def shrink_in_place(
    job_dir: Path, record: dict, good: tuple[str, ...], overrides: list[str], why: str
) -> Decision:
    """The job's launch composed again with ``overrides`` (the chain's: fewer nodes, the
    planner's grid) and resolved as a launch resolves it; its grid and training settings
    replace spec.json's for the next step. Nothing fits: the chain takes over."""
    from axonn_launch.common.spec import JobSpec
    from axonn_launch.config.compose import ConfigError, load
    from axonn_launch.config.resolve import resolve

    launch = new_overrides(original_overrides(job_dir, record), overrides, ())
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the next step's options
            resolved = resolve(load(launch))
    except (ConfigError, ValueError) as error:
        return Decision(stop=f"{why}; no smaller grid: {error}; the chain takes over")
    paths = JobPaths(job_dir)
    spec = JobSpec.load(paths.spec)
    dataclasses.replace(spec, grid=resolved.grid, train=resolved.train).save(paths.spec)
    shrunk = {"nodes": resolved.nodes, "grid": resolved.grid.as_dict(), "from": spec.grid.as_dict()}
    nodes = good[: resolved.nodes]
    return Decision(nodes=nodes, tasks=resolved.nodes * resolved.tasks_per_node, shrunk=shrunk)


def ended_step(
    job_dir: Path, record: dict, settings: dict, exit_status: int, environ: dict[str, str]
) -> EndedStep:
    """The step that just ended: the newest recorded one, else the job's first step (on
    the first ``nodes`` of the allocation, as srun places it)."""
    job_id = environ.get("SLURM_JOB_ID", "")
    steps = [s for s in settings.get("steps") or [] if s.get("job_id") == job_id]
    tasks_per_node = int(settings["tasks_per_node"])
    if steps:
        last = steps[-1]
        return EndedStep(job_id, exit_status, tuple(last["nodes"]), tasks_per_node,
                         float(last["started"]), dict(last.get("offsets") or {}))  # fmt: skip
    first = slurmtext.expand_nodelist(
        environ.get(NODES_VARIABLE) or environ.get("SLURM_JOB_NODELIST", "")
    )  # a packed point's first step ran on the nodes its pack gave it
    nodes = tuple(first[: int(settings["nodes"])])
    return EndedStep(job_id, exit_status, nodes, tasks_per_node, attempt_start(record))


def stop_reason(root: Path, settings: dict, failure: str, action: str) -> str:
    """Why no restart in place follows ('' when one may): a stopped run, a class the
    policy does not resume, or no restart left."""
    chain_record = chain.chain_of(root)
    if chain_record.get("state") == chain.STOPPED:
        return "the run was stopped (jobs stop)"
    if action not in RESUMING:
        return f"{failure}: policy {action}"
    done = len(settings.get("steps") or [])
    if done >= int(settings["limit"]):
        return f"recovery.in_job_restarts={settings['limit']}: {done} restarts in place made"
    return ""


def attempt_of(job_dir: Path, ended: EndedStep, diagnosis: failures.Diagnosis, action: str) -> dict:
    """The chain's record of the attempt that ended in place (``batch/recovery.py``'s
    fields, with the step's nodes)."""
    metrics = last_metrics(job_dir)
    return {"job_dir": str(job_dir), "job_id": ended.job_id, "class": diagnosis.failure,
            "action": action, "step": int(metrics["step"]) if metrics else None,
            "reason": diagnosis.reason[:300], "failed_step": diagnosis.detail.get("step"),
            "checkpointed": checkpointed_step(job_dir), "ended_at": time.time(),
            "in_place": True, "nodes": list(ended.nodes),
            "bad_nodes": list(diagnosis.bad_nodes)}  # fmt: skip


def held_nodes(job_id: str, environ: dict[str, str]) -> tuple[str, ...]:
    """The nodes the job holds now and that are up (a job with ``--no-kill`` loses a
    failed node from its allocation; a node may still be listed while going down). A
    packed point holds only the nodes its pack gave it."""
    held = SLURM.job_nodes(job_id) or slurmtext.expand_nodelist(
        environ.get("SLURM_JOB_NODELIST", "")
    )
    own = slurmtext.expand_nodelist(environ.get(NODES_VARIABLE, ""))
    held = tuple(n for n in held if n in own) if own else tuple(held)
    down = set(SLURM.down_nodes(held))
    return tuple(n for n in held if n not in down)


def next_nodes(
    ran_on: tuple[str, ...], held: tuple[str, ...], bad: tuple[str, ...], settings: dict
) -> tuple[tuple[str, ...], str]:
    """The next step's nodes for the grid's own node count: the ended step's that are still
    good, then spares; or why there are too few (``fewer_nodes`` then decides)."""
    wanted = int(settings["nodes"])
    good = usable(ran_on, held, bad)
    if len(good) < wanted:
        return (), (
            f"{len(good)} of the {wanted} nodes the grid needs left in the allocation"
            f" (recovery.spare_nodes={settings.get('spare_nodes', 0)}): the chain takes over"
        )
    return good[:wanted], ""


def usable(ran_on: tuple[str, ...], held: tuple[str, ...], bad: tuple[str, ...]) -> tuple[str, ...]:
    """The nodes a next step may use, in order: the ended step's that are still good, then
    the other nodes held (spares)."""
    good = [n for n in ran_on if n in held and n not in bad]
    good += [n for n in held if n not in good and n not in bad]
    return tuple(good)


def record_attempt(root: Path, record: dict, attempt: dict, why: str) -> None:
    """The attempt joins the run's chain, marked restarted in place or not (``why``)."""
    attempt["restarted"] = not why
    chain_record = chain.chain_of(root)
    chain.set_chain(root, chain.settings_of(record),
                    attempts=[*chain_record.get("attempts", []), attempt])  # fmt: skip


def start_next_step(job_dir: Path, job_id: str, decision: Decision) -> None:
    """Record the next step (its nodes, start, where its log lines begin and a smaller grid)
    and clear the ended step's result pickles: a result is then always the newest step's.
    A shrunk grid's node count is what later restarts of the job ask for."""
    step = {"job_id": job_id, "nodes": list(decision.nodes), "started": time.time(),
            "offsets": log_sizes(job_dir, job_id)}  # fmt: skip
    if decision.shrunk:
        step["shrunk_to"] = decision.shrunk
    with record_lock(job_dir):
        record = read_record(job_dir)
        settings = dict(record[RECORD_KEY])
        settings["steps"] = [*settings.get("steps", []), step]
        if decision.shrunk:
            settings["nodes"] = decision.shrunk["nodes"]
        record[RECORD_KEY] = settings
        write_record_file(job_dir, record)
    for result in slurm_task_files(job_dir, job_id)[SLURM_RESULT].values():
        Path(result).unlink(missing_ok=True)


def run_decision(job_dir: Path, exit_status: int) -> int:
    """``python -m axonn_launch.restart``: print the next step's srun options (exit 0), or
    say why the job ends (exit 1)."""
    try:
        decision = decide(job_dir, exit_status)
    except (OSError, ValueError, KeyError, subprocess.SubprocessError) as error:
        decision = Decision(stop=f"no restart in place: {type(error).__name__}: {error}")
    if decision.stop:
        print(f"axonn_launch: restart in place: no: {decision.stop}", file=sys.stderr, flush=True)
        return 1
    line = f"restarting in place on {','.join(decision.nodes)}"
    if decision.shrunk:
        line += f", the grid shrunk to {decision.shrunk['grid']} (recovery.on_fewer_nodes=shrink)"
    print(f"axonn_launch: {line}", file=sys.stderr, flush=True)
    print(decision.srun_options(), flush=True)
    return 0
