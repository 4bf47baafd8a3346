"""Restarts in place, the launch's side: a failed training step of a Slurm job runs again
inside the same job, on the nodes it still holds, before any new job is queued
(``recovery.in_job_restarts``), and ``recovery.spare_nodes`` more nodes are asked for to
take a failed node's place.

Here: whether a job restarts in place, its batch script's loop (``render.InPlace``), its
sbatch options and what job.json keeps; the decision after a failure is
``batch/restart.py``. Why in the batch script: ``docs/recovery.md`` ("in place").
"""

from __future__ import annotations

from pathlib import Path

from axonn_launch import scheduler
from axonn_launch.config.compose import ConfigError, LaunchConfig
from axonn_launch.config.resolve import Resolved
from axonn_launch.submit import chain, pack, render

RECORD_KEY = "in_job"  # job.json: the settings, and each step's nodes, start and log offsets


# --- the launch side -------------------------------------------------------------------


def enabled(cfg: LaunchConfig) -> bool:
    """Slurm jobs restart in place unless ``recovery=off`` or ``in_job_restarts=0``; a
    rehearsal never (it runs once). A QOS that forbids chains still restarts in place."""
    on = cfg.recovery.mode != "off" and cfg.recovery.in_job_restarts > 0
    return on and scheduler.of(cfg.machine).queued and not cfg.rehearse


def spares(cfg: LaunchConfig) -> int:
    """The nodes the job asks for beyond its grid's (a packed point: none, its pack holds
    the nodes)."""
    return cfg.recovery.spare_nodes if enabled(cfg) and not pack.packed(cfg) else 0


def check(cfg: LaunchConfig) -> None:
    """The login node's check of the in-place settings (ConfigError, one line)."""
    for key in ("in_job_restarts", "spare_nodes"):
        if getattr(cfg.recovery, key) < 0:
            raise ConfigError(f"recovery.{key}={getattr(cfg.recovery, key)}: must be 0 or more")
    if cfg.recovery.spare_nodes and not scheduler.of(cfg.machine).queued:
        raise ConfigError(
            f"recovery.spare_nodes={cfg.recovery.spare_nodes}: machine={cfg.machine.name} has"
            " no scheduler to hold spare nodes; valid: 0, or a Slurm machine"
        )


def in_place(
    cfg: LaunchConfig, resolved: Resolved, job_dir: Path, python: str
) -> render.InPlace | None:
    """The batch script's restart loop for this job, or None when it has none. A packed
    point always has one: its first step's nodes are its pack's choice."""
    packed = pack.packed(cfg)
    if not enabled(cfg) and not packed:
        return None
    tasks = resolved.nodes * resolved.tasks_per_node
    variable = pack.NODES_VARIABLE if packed else ""
    return render.InPlace(python=python, job_dir=str(job_dir), nodes=resolved.nodes,
                          tasks=tasks, nodes_variable=variable)  # fmt: skip


def job_parameters(cfg: LaunchConfig, params: dict) -> dict:
    """submitit's parameters: with spares, ``--no-kill``, so that a node failure leaves the
    job running on the nodes it still holds (sbatch(1))."""
    if not spares(cfg):
        return params
    extra = {**params.get("additional_parameters", {}), "no-kill": True}
    return {**params, "additional_parameters": extra}


def record_fields(cfg: LaunchConfig, resolved: Resolved) -> dict:
    """What job.json keeps for the decisions: the limit, the grid's nodes and the policy."""
    if not enabled(cfg) and not pack.packed(cfg):
        return {}
    policy = {name: chain.policy_of(cfg.recovery, name) for name in chain.DEFAULT_POLICY}
    limit = cfg.recovery.in_job_restarts if enabled(cfg) else 0
    settings = {"limit": limit, "spare_nodes": spares(cfg),
                "nodes": resolved.nodes, "tasks_per_node": resolved.tasks_per_node,
                "policy": policy, "steps": []}  # fmt: skip
    return {RECORD_KEY: settings}
