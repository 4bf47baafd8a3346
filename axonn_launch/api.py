"""The launcher from Python (a notebook, a script), without subprocesses: docs/api.md.

``compose`` makes the one typed config a launch uses (Hydra composes, once); ``plan`` ranks
grids for it; ``launch`` runs it as ``python -m axonn_launch`` does and returns a ``Job``;
``status``, ``resubmit`` and ``stop`` act on job dirs as ``jobs`` does. A bad input raises
``LaunchError`` with the one line the command line prints, before anything is written.
Login-node code: never imports torch (a local job's ranks run in their own processes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

from axonn_launch.batch.resubmit import MAX_ATTEMPTS, resubmit_one
from axonn_launch.common.jobdir import CONSOLE_LOG, JobPaths, RecordError, read_record_or_empty
from axonn_launch.config.compose import (
    CONFIG_MODULE,
    SITE_ENV,
    ConfigError,
    LaunchConfig,
    site_record,
    to_launch_config,
    using_site,
)
from axonn_launch.config.compose import compose as hydra_compose
from axonn_launch.cost import plan_report as planner
from axonn_launch.cost.perf import Calibration, profile_calibration
from axonn_launch.records.jobdirs import JOB_DIR_HINT, NotAJobPath
from axonn_launch.records.runs import runs
from axonn_launch.records.status import (
    RUN_RECOVERING,
    RUN_RUNNING,
    RUN_WAITING,
    JobStatus,
    collect,
)
from axonn_launch.submit import chain, dirguard, pipeline
from axonn_launch.submit.pipeline import Outcome
from axonn_launch.submit.pipeline import launch as pipeline_launch
from axonn_launch.submit.sweep import check_objective
from axonn_launch.usage import one_line

__all__ = [
    "Job",
    "JobStatus",
    "LaunchError",
    "RunConfig",
    "compose",
    "launch",
    "plan",
    "resubmit",
    "status",
    "stop",
]

RUN_DIR_KEY = "hydra.run.dir"
PRIMARY_CONFIG = "config"  # Hydra's primary config, conf/config.yaml (compose.compose)
LAUNCHER = "python -m axonn_launch"  # argv[0] of the launch job.json records
ACTIVE_RUN_STATES = (RUN_RUNNING, RUN_WAITING, RUN_RECOVERING)


class LaunchError(Exception):
    """A bad input or a refusal, as the one line the command line prints after ``error:``."""


@contextlib.contextmanager
def one_line_errors(*kinds: type[BaseException]) -> Iterator[None]:
    """The command line's user errors (``ConfigError`` and ``kinds``) as ``LaunchError``."""
    try:
        yield
    except (ConfigError, *kinds) as exc:
        raise LaunchError(one_line(exc)) from exc


@dataclass(frozen=True)
class RunConfig:
    """One composed run: ``launch`` is the typed config, ``tree`` the resolved composition
    (the job dir's config.yaml is made of it), ``overrides`` what composed it."""

    overrides: tuple[str, ...]
    launch: LaunchConfig
    tree: Any  # the composed DictConfig
    run_dir: str = ""  # hydra.run.dir as given; "" = the launcher's default under ./jobs
    site: str | None = None  # the site directory it was composed with (AXONN_SITE_DIR)

    def with_values(self, **values: Any) -> RunConfig:
        """This run with top-level keys changed (``dry_run=True``), in all three views."""
        if not values:
            return self
        tree = self.tree.copy()
        for key, value in values.items():
            tree[key] = value
        said = [f"{k}={json.dumps(v)}" for k, v in values.items()]
        kept = [o for o in self.overrides if o.lstrip("+~").split("=", 1)[0] not in values]
        return dataclasses.replace(
            self,
            overrides=(*kept, *said),
            launch=dataclasses.replace(self.launch, **values),
            tree=tree,
        )


def compose(overrides: Sequence[str] = (), site: str | Path | None = None) -> RunConfig:
    """The run that ``python -m axonn_launch OVERRIDES`` launches. ``site``: a site directory
    (``machine/<name>.yaml``, ``local/default.yaml``), used as ``AXONN_SITE_DIR=site`` uses
    it (docs/site.md), by this composition and by ``launch``, which records it for
    resubmission; None: ``AXONN_SITE_DIR``'s, if set. ``hydra.run.dir=DIR`` names the job dir."""
    given = [str(o) for o in overrides]
    bad = [o for o in given if o.startswith("-") or "=" not in o]
    if bad:
        raise LaunchError(f"{bad[0]!r}: expected KEY=VALUE (a Hydra override)")
    run_dirs = [o.split("=", 1)[1] for o in given if o.startswith(RUN_DIR_KEY + "=")]
    to_compose = [o for o in given if not o.startswith(RUN_DIR_KEY + "=")]
    with one_line_errors(), using_site(site_path(site)):
        tree = hydra_compose(to_compose)
        cfg = to_launch_config(tree)
        check_objective(cfg)
        used = site_record()
    return RunConfig(tuple(given), cfg, tree, run_dirs[-1] if run_dirs else "", used)


def site_path(site: str | Path | None) -> str | None:
    """``site`` as ``AXONN_SITE_DIR`` takes it (absolute); None: the environment's."""
    if site is None:
        return os.environ.get(SITE_ENV)
    path = Path(site).expanduser()
    if not path.is_dir():
        raise LaunchError(
            f"site={str(site)!r}: not a directory; valid: a directory holding"
            " machine/<name>.yaml and local/default.yaml (docs/site.md), or None"
        )
    return str(path.absolute())


def plan(
    config: RunConfig, *, top: int = 5, calibration: str | Path | None = None
) -> dict[str, Any]:
    """What ``python -m axonn_launch.plan OVERRIDES output=json`` prints, as a dict: its
    ``plans`` are the ranked grids (empty, with ``why_none``, when none can run)."""
    cfg = config.launch
    if top < 1 or (cfg.nodes is not None and cfg.nodes < 1):
        raise LaunchError(f"top={top} nodes={cfg.nodes}: must be positive integers")
    with one_line_errors(ValueError, TypeError):
        args = planner.PlanArgs(
            machine=cfg.machine,
            model=cfg.model,
            train=cfg.train,
            nodes=cfg.nodes,
            top=top,
            output="json",
            calibration=calibration_of(cfg, calibration),
            overrides=config.overrides,
            spares=planner.spares_of(cfg, None),
        )
        text, _ = planner.plan_report(args)
    return json.loads(text)


def calibration_of(cfg: LaunchConfig, path: str | Path | None) -> Calibration | None:
    """A calibration file's measurements over the profile's (``plan calibration=PATH``)."""
    if path is None:
        return None
    return planner.read_calibration(str(path), profile_calibration(cfg.machine.hardware))


@dataclass(frozen=True)
class Job:
    """A launched job: its dir, its job ids and how its launch ended (``outcome``:
    dry_run, submitted, completed, failed, interrupted)."""

    job_dir: Path
    job_ids: tuple[str, ...]
    outcome: str
    message: str = ""

    @property
    def job_id(self) -> str:
        return self.job_ids[-1] if self.job_ids else ""

    def status(self) -> JobStatus:
        return status(self.job_dir)

    def wait(self, *, poll_s: float = 2.0, timeout_s: float | None = None) -> JobStatus:
        """Its status once it (and a run that recovers itself) has ended."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            now = self.status()
            if not running(now):
                return now
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.job_dir}: still {now.state} after {timeout_s} s")
            time.sleep(poll_s)

    def stop(self) -> str:
        return stop(self.job_dir)

    def resubmit(self, overrides: Sequence[str] = (), *, out: TextIO | None = None) -> Job:
        return resubmit(self.job_dir, overrides, out=out)


def running(row: JobStatus) -> bool:
    """Whether a job is queued or running, or its run is still recovering."""
    active = row.state == "RUNNING" or row.state.startswith("PENDING")
    return active or row.run_state in ACTIVE_RUN_STATES


def launch(
    config: RunConfig,
    *,
    dry_run: bool | None = None,
    wait: bool | None = None,
    out: TextIO | None = None,
) -> Job:
    """Launch ``config`` as ``python -m axonn_launch`` does: the same checks before anything
    is written, then the job dir, the dry run, the local run or the submission. ``dry_run``
    and ``wait`` override the config's; ``out``: where its summary goes (stdout)."""
    values = {k: v for k, v in (("dry_run", dry_run), ("wait", wait)) if v is not None}
    run = config.with_values(**values)
    job_dir = Path(run.run_dir) if run.run_dir else default_job_dir(run.launch.name)
    with one_line_errors(), using_site(run.site), launcher_log() as log:
        checked = pipeline.check_run(run.tree, run.launch, str(job_dir.absolute()))
        target = claimed_dir(job_dir.absolute(), run.launch)
        log.job_dir = target
        outcome = pipeline_launch(
            checked,
            job_dir=target,
            config=as_container(run.tree),
            command_line=[LAUNCHER, *run.overrides],
            out=out or sys.stdout,
        )
    return job_of(outcome)


def claimed_dir(job_dir: Path, cfg: LaunchConfig) -> Path:
    """The dir the launch writes: ``job_dir``, or with ``resume=true`` the new attempt that
    continues its run (what ``dirguard.GuardJobDir`` does for a Hydra run)."""
    target = dirguard.check(job_dir, cfg)
    if target != job_dir:
        dirguard.CONTINUING[str(target.resolve())] = job_dir
    return target


def job_of(outcome: Outcome) -> Job:
    """The handle of a launch; a launch refused (by sbatch) or invalid raises."""
    if outcome.status in ("invalid", "refused"):
        raise LaunchError(outcome.message or f"{outcome.job_dir}: {outcome.status}")
    ids = read_record_or_empty(outcome.job_dir).get("job_ids") or [outcome.job_id]
    return Job(Path(outcome.job_dir), tuple(i for i in ids if i), outcome.status, outcome.message)


def default_job_dir(name: str) -> Path:
    """``hydra.run.dir`` of the packaged config (``jobs/<name>/<time>``), for this run."""
    import yaml
    from hydra.core.utils import setup_globals
    from omegaconf import OmegaConf

    text = resources.files(CONFIG_MODULE).joinpath(f"{PRIMARY_CONFIG}.yaml").read_text()
    template = yaml.safe_load(text)["hydra"]["run"]["dir"]
    setup_globals()  # Hydra's ``now``
    return Path(str(OmegaConf.create({"name": name, "dir": template}).dir))


def as_container(tree: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(tree, resolve=True)


class BufferedLog(logging.Handler):
    """The launch's own records, for ``<job dir>/axonn_launch.log`` (Hydra's file log)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.job_dir: Path | None = None
        self.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def write(self) -> None:
        if self.job_dir is None or not self.job_dir.is_dir() or not self.lines:
            return
        with open(self.job_dir / CONSOLE_LOG, "a") as log:
            log.write("\n".join(self.lines) + "\n")


@contextlib.contextmanager
def launcher_log() -> Iterator[BufferedLog]:
    """The launcher logs to its job dir only: its console lines are printed already."""
    logger = logging.getLogger("axonn_launch")
    handler, level = BufferedLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.write()


def status(job_dir: str | Path) -> JobStatus:
    """``jobs status --json JOB_DIR``'s row of this job's run (its newest attempt)."""
    with one_line_errors(NotAJobPath, RecordError):
        rows = runs(collect([str(job_dir)], later_attempts=True))
    want = str(Path(job_dir).resolve())
    mine = [
        r for r in rows if want in {str(Path(d).resolve()) for d in (r.job_dir, r.run_dir) if d}
    ]
    if not mine:
        raise LaunchError(f"{job_dir}: not a job dir; {JOB_DIR_HINT}")
    return mine[0]


def resubmit(
    job_dir: str | Path, overrides: Sequence[str] = (), *, out: TextIO | None = None
) -> Job:
    """``jobs resubmit JOB_DIR OVERRIDES``: the next attempt of a failed job (or an
    extension of a completed one, with ``train.steps=N``). A refusal raises ``LaunchError``."""
    args = argparse.Namespace(
        overrides=[str(o) for o in overrides], only=None, max_attempts=MAX_ATTEMPTS, dry_run=False
    )  # jobs resubmit's defaults
    row = status(job_dir)
    with one_line_errors(ValueError, TypeError):
        said = resubmit_one(row, args, out or sys.stdout)
    if said.startswith("skip"):
        raise LaunchError(said.split(": ", 1)[-1])
    print(said, file=out or sys.stdout, flush=True)
    target = read_record_or_empty(row.job_dir).get("resubmitted_as") or ""
    return Job(Path(target), tuple(read_record_or_empty(target).get("job_ids") or ()), "submitted")


def stop(job_dir: str | Path) -> str:
    """``jobs stop JOB_DIR``: end a run (its newest attempt, and nothing resubmitted)."""
    if not JobPaths(job_dir).record.is_file():
        raise LaunchError(f"{job_dir}: not a job dir; {JOB_DIR_HINT}")
    with one_line_errors(chain.NotOurJob, RecordError):
        return chain.stop(Path(job_dir))
