"""A launch identical to a job still queued or running beside it is most often the same
command run twice (a detached job's shell history, a second terminal): it would train the
same thing twice and, on Slurm, chain a second recovery job. ``launch`` asks
``refuse_duplicate`` before it writes anything; ``force=true`` launches anyway, warning.

What "identical", "beside" and "running" mean, and the exceptions: ``docs/launch.md``
("submit/duplicates.py"). Login-node code: never imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from axonn_launch.common.jobdir import JobPaths, last_job_id, read_record_or_empty
from axonn_launch.common.slurmtext import ACTIVE_STATES, base_state
from axonn_launch.config.compose import ConfigError, LaunchConfig
from axonn_launch.records.jobdirs import is_dry_run, saved_config
from axonn_launch.scheduler import processes
from axonn_launch.scheduler.slurm_queries import squeue_states

# keys that name or follow a run without changing what it trains
IGNORED_KEYS = ("name", "wait", "dry_run", "force")
# job.json's status while the launcher believes the job queued or running
UNFINISHED = ("submitted", "running")
# what injects a fault into the job (train/health/faults.py, train/checkpoint/manager.py)
FAULT_ENV = ("AXONN_FAULT", "AXONN_CHECKPOINT_FAULT")
# squeue lists a job that has ended until its epilog is done: not a running job
ENDING_STATES = frozenset({"COMPLETING", "STAGE_OUT", "SIGNALING"})

log = logging.getLogger(__name__)


class DuplicateLaunch(ConfigError):
    """An identical job is queued or running beside this launch (one line; exit code 2)."""


@dataclass(frozen=True)
class Existing:
    job_dir: Path
    job_id: str
    state: str  # squeue's (PENDING, RUNNING, ...) or RUNNING for a live local supervisor


def config_hash(config: dict) -> str:
    """The hash of a resolved config, without ``IGNORED_KEYS``."""
    kept = {k: v for k, v in config.items() if k not in IGNORED_KEYS}
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def unfinished_beside(job_dir: Path) -> list[tuple[Path, dict]]:
    """(dir, job.json) of the jobs in ``job_dir``'s folder (itself included) that the
    launcher last saw queued or running; dry runs never ran."""
    found = []
    with contextlib.suppress(OSError):
        for folder in sorted(job_dir.parent.iterdir()):
            if not JobPaths(folder).record.is_file():
                continue
            record = read_record_or_empty(folder)
            if record.get("status") in UNFINISHED and not is_dry_run(record):
                found.append((folder, record))
    return found


def identical_jobs(config: dict, job_dir: Path) -> list[Existing]:
    """The jobs beside ``job_dir`` with the same config hash that are queued or running."""
    wanted = config_hash(config)
    same = [
        (folder, last_job_id(record))
        for folder, record in unfinished_beside(job_dir)
        if (saved := saved_config(folder)) is not None and config_hash(saved) == wanted
    ]
    slurm_ids = [job_id for _, job_id in same if job_id and not job_id.startswith("local-")]
    queued = squeue_states(slurm_ids) if slurm_ids else {}
    found = []
    for folder, job_id in same:
        if job_id.startswith("local-") and processes.live_supervisors([folder]):
            found.append(Existing(folder, job_id, "RUNNING"))
        elif job_id in queued and live_state(queued[job_id].state):
            found.append(Existing(folder, job_id, queued[job_id].state))
    return found


def sweeping() -> bool:
    """Whether this launch is a point of a Hydra sweep (``-m``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def live_state(state: str) -> bool:
    base = base_state(state)
    return base in ACTIVE_STATES and base not in ENDING_STATES


def refuse_duplicate(cfg: LaunchConfig, config_yaml: str, job_dir: Path) -> None:
    """Raise ``DuplicateLaunch`` naming the identical queued or running job, unless this
    is a dry run (it starts nothing), a fault injection, a sweep's point or ``force=true``
    (then one warning line)."""
    if cfg.dry_run or any(os.environ.get(name) for name in FAULT_ENV) or sweeping():
        return
    import yaml

    found = identical_jobs(yaml.safe_load(config_yaml) or {}, Path(job_dir).resolve())
    if not found:
        return
    first = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    said = f"job {first.job_id} ({first.state}) in {first.job_dir}{more} has the same config"
    if cfg.force:
        warning = f"{said}; launching another (force=true)"
        print(f"warning: {warning}", file=sys.stderr)
        log.warning(warning)
        return
    raise DuplicateLaunch(
        f"{said} and is not over: nothing submitted; follow it with python -m"
        f" axonn_launch.jobs status {first.job_dir}, or add force=true to launch another"
    )
