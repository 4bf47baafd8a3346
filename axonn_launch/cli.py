"""`python -m axonn_launch [-m] key=value ...`: the Hydra application.

A run is composed once, by Hydra, and resolved once, by ``ValidateRun`` before Hydra makes
its job dir; ``hydra_entry`` launches that resolution (``run_checks``). A sweep's or a
study's points are composed and checked first (``check_arguments``). Bad input ends with
one line and exit code 2, with nothing written or submitted. HYDRA_FULL_ERROR=1: tracebacks.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import shutil
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from axonn_launch import scheduler
from axonn_launch.config.compose import (
    ConfigError,
    LaunchConfig,
    check_profile,
    compose,
    composition_error,
    register_resolvers,
    split_argv,
    to_launch_config,
)
from axonn_launch.config.sweep_compose import (
    SharedComposition,
    hydra_job_copies_and_yaml,
    shared_sweep_composition,
)
from axonn_launch.records import provenance
from axonn_launch.scheduler import processes
from axonn_launch.submit import chain, pipeline, rank_rehearsal
from axonn_launch.submit.pipeline import EXIT_BAD_INPUT, Checked, check_run, launch, study_callback
from axonn_launch.submit.sweep import (
    PointOutcome,
    check_objective,
    direction_warning,
    expand_sweep,
    for_sweeper,
    sweeper_name,
    with_objective,
)
from axonn_launch.usage import register_help_resolver

HYDRA_FLAGS_WITHOUT_CHECK = {
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--cfg",
    "-c",
    "--shell-completion",
    "-sc",
    "--version",
    "--resolve",
}


log = logging.getLogger(__name__)
FULL_ERROR = "HYDRA_FULL_ERROR"
_USER_FULL_ERROR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "axonn_user_hydra_full_error", default=None
)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def hydra_entry(cfg: DictConfig) -> PointOutcome:
    """One run or one sweep point; its ``float()`` is the objective (``sweep.py``)."""
    give_back_full_error()
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        launch_cfg = point_config(cfg, hydra_cfg if sweeping else None)
        if not scheduler.of(launch_cfg.machine).on_this_computer or launch_cfg.dry_run:
            processes.dismiss_early_supervisor()  # no local job to hand it: its imports stop
        checked = run_checks(launch_cfg, job_dir)
        outcome = launch(
            checked,
            job_dir=job_dir,
            config=OmegaConf.to_container(cfg, resolve=True),
            command_line=list(sys.argv),
        )
        outcome = rank_rehearsal.after_launch(launch_cfg, checked.resolved, outcome)
    except ConfigError as exc:
        if not sweeping:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT) from None
        print(f"point {hydra_cfg.job.num}: invalid: {exc}", file=sys.stderr)
        shutil.rmtree(job_dir, ignore_errors=True)  # nothing kept for an invalid point
        return PointOutcome("invalid", "", message=str(exc))
    if not sweeping and outcome.exit_code:
        raise SystemExit(outcome.exit_code)  # Hydra does not pass the return value on
    result = with_objective(outcome, launch_cfg.objective)
    if sweeping:
        log.info("point %s: %s, %s=%s", hydra_cfg.job.num, result.status, result.objective,
                 result.value)  # fmt: skip
    return result


def point_config(cfg: DictConfig, hydra_cfg: Any) -> LaunchConfig:
    """The typed config of this run; in a sweep, as its sweeper needs it."""
    launch_cfg = to_launch_config(cfg)
    if hydra_cfg is None:
        check_objective(launch_cfg)
        return launch_cfg
    sweeper = sweeper_name(hydra_cfg.sweeper._target_)
    point_cfg = for_sweeper(launch_cfg, sweeper)
    if point_cfg.wait and not launch_cfg.wait:
        log.info("the %s sweeper optimizes %s: waiting for the job", sweeper, point_cfg.objective)
    warning = direction_warning(launch_cfg.objective, hydra_cfg.sweeper.get("direction"))
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
        log.warning(warning)
    return point_cfg


@dataclasses.dataclass
class RunHandoff:
    """A run's checks and resolution, from ``ValidateRun`` to ``hydra_entry``. Hydra calls
    both in this process but passes the task function only the config, so the callback
    leaves them here with the config it checked, and the entry takes them once
    (``run_checks``). One slot: checking never looks here."""

    cfg: LaunchConfig | None = None
    checked: Checked | None = None

    def hand(self, cfg: LaunchConfig, checked: Checked) -> None:
        self.cfg, self.checked = cfg, checked

    def take(self, cfg: LaunchConfig) -> Checked | None:
        """The checks handed for ``cfg``, once; None when none were (a sweep point)."""
        handed, checked = self.cfg, self.checked
        self.cfg = self.checked = None
        return checked if handed == cfg else None


RUN_HANDOFF = RunHandoff()


def run_checks(cfg: LaunchConfig, job_dir: Path) -> Checked:
    """The one run of this job's checks, with its resolution: ``ValidateRun``'s for a run,
    made here for a sweep point (Hydra calls no run callback for it)."""
    handed = RUN_HANDOFF.take(cfg)
    return handed if handed is not None else pipeline.check(cfg, str(job_dir.resolve()))


class ValidateRun(Callback):
    """A run (not a sweep) is checked and resolved here (conf/config.yaml's
    ``hydra.callbacks``): on the config Hydra composed, before Hydra creates the job dir,
    so that bad input writes nothing and the config is composed no more often than Hydra
    does it itself. The checks and resolution go to ``hydra_entry`` (``RUN_HANDOFF``)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        tree = OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])
        try:
            check_profile(config)  # one line naming the profile's file (compose.py)
            cfg = to_launch_config(tree)
            checked = check_run(tree, cfg, run_dir_of(config))
        except ConfigError as exc:  # Hydra would only warn of an exception from a callback
            if _USER_FULL_ERROR.get() == "1":
                traceback.print_exc()
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT) from None
        RUN_HANDOFF.hand(cfg, checked)


class LoggedNotPrinted(logging.Filter):
    """For Hydra's console handler (conf/config.yaml): the launcher prints what the
    console needs itself and logs the same to the job dir's axonn_launch.log, so its
    own records stay off the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("axonn_launch")


def check_arguments(argv: list[str]) -> None:
    """Before Hydra runs: compose each point of a sweep and check each trial an optimizing
    sweeper may pick, or check a study run's settings before Hydra makes its callback of
    them. A plain run is checked and resolved by ``ValidateRun``, on Hydra's composition."""
    overrides, valued, bare = split_argv(argv)
    if bare & HYDRA_FLAGS_WITHOUT_CHECK or {
        "--config-path",
        "-cp",
        "--config-name",
        "-cn",
        "--experimental-rerun",
    } & set(valued):
        return  # Hydra's own reports, or another primary config: Hydra checks those
    sweeping = bool(bare & {"-m", "--multirun"})
    study = any(o.lstrip("+").startswith("study=") for o in overrides)
    if not sweeping and not study:
        return  # ValidateRun checks a run on Hydra's own composition, before its job dir
    sweeper = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra/sweeper=")), "")
    overrides = [  # Hydra checks its own keys and groups (hydra/launcher=..., hydra/sweeper=...)
        o
        for o in overrides
        if not o.startswith(("hydra.", "hydra/")) or o.startswith("hydra.searchpath")
    ]
    config_dir = valued.get("--config-dir") or valued.get("-cd")
    if config_dir:
        overrides.append(f"hydra.searchpath=[file://{os.path.abspath(config_dir)}]")
    optimizing = sweeping and sweeper not in ("", "basic")
    points = expand_sweep(overrides, interval_ends=optimizing) if sweeping else [overrides]
    shared = SharedComposition()  # one composition per distinct set of group choices
    for point in distinct(points):
        tree = shared.tree(point) if sweeping else compose(point)
        cfg = for_sweeper(to_launch_config(tree), sweeper or "basic")
        if not sweeping:  # Hydra makes a study's callback before ValidateRun runs
            study_callback(tree)
        elif optimizing:
            check_trial(tree, cfg, point, sweeper)
    if sweeping:
        jobs = trials_asked(argv) if optimizing else len(points)
        for warning in chain.sweep_queue_warnings(cfg, jobs):
            print(f"warning: {warning}", file=sys.stderr)


def distinct(points: list[list[str]]) -> list[list[str]]:
    """Each distinct point once (``train.seed=1,1`` checks one)."""
    return [list(point) for point in dict.fromkeys(tuple(p) for p in points)]


def trials_asked(argv: list[str]) -> int:
    """The trials an optimizing sweeper is asked for (``hydra.sweeper.n_trials``; 0 unknown)."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.sweeper.n_trials=")]
    return int(given[-1]) if given and given[-1].isdigit() else 0


def run_dir_prefix(overrides: list[str]) -> str:
    """The part of the job dir known before Hydra runs: ``hydra.run.dir`` up to its first
    interpolation (the default puts job dirs under ./jobs), made absolute."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    prefix = (given[-1] if given else "jobs/").split("${", 1)[0]
    return os.path.abspath(prefix or ".")


def run_dir_of(config: DictConfig) -> str:
    """The run's job dir, as Hydra will make it: resolved once here, as ``GuardJobDir`` does
    (Hydra's ``now`` is cached on this config). A ``resume=true`` attempt's dir is beside it."""
    return str(Path(os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir")))).resolve())


def check_trial(tree: DictConfig, cfg: LaunchConfig, point: list[str], sweeper: str) -> None:
    """An optimizing sweeper may pick any point of its search space, and one invalid trial
    stops it (Hydra's ``max_failure_rate`` is 0): so every combination of choices and of
    interval ends must be valid before the first trial runs."""
    try:
        check_run(tree, cfg, run_dir_prefix([]))
    except ConfigError as exc:
        trial = " ".join(point)
        raise ConfigError(f"{exc} (a trial the {sweeper} sweeper may pick: {trial})") from None


def main() -> None:
    processes.start_early_supervisor(sys.argv[1:])  # a local job's imports start meanwhile
    try:
        check_arguments(sys.argv[1:])
    except ConfigError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    register_help_resolver()  # --help names the other commands (conf/config.yaml)
    register_resolvers()  # sweep points' names (conf/config.yaml)
    with (
        composition_errors_in_one_line(split_argv(sys.argv[1:])[0]),
        mode_told(sys.argv[1:]),
        shared_sweep_composition(),  # a sweep's points share one composition
        hydra_job_copies_and_yaml(),  # each job's config copies, .hydra/*.yaml
        provenance.read_once(),  # a sweep's points share the checkout's state and versions
    ):
        hydra_entry()


@contextlib.contextmanager
def mode_told(argv: list[str]) -> Iterator[None]:
    """Hydra (1.3) composes a run's whole config once only to read ``hydra.mode``, then
    again to run it. Without ``-m``, another config dir or a ``hydra.mode`` override, the
    mode is RUN, which Hydra also assumes when that probe says nothing: so it is skipped."""
    from hydra._internal.hydra import Hydra

    overrides, valued, bare = split_argv(argv)
    told = not bare & {"-m", "--multirun"} and not set(valued) & {"--config-dir", "-cd"}
    told = told and not any(o.lstrip("+~").startswith("hydra.mode") for o in overrides)
    probe = getattr(Hydra, "get_mode", None)
    if not told or probe is None:
        yield
        return
    Hydra.get_mode = lambda self, config_name, overrides: None
    try:
        yield
    finally:
        Hydra.get_mode = probe


@contextlib.contextmanager
def composition_errors_in_one_line(overrides: list[str]) -> Iterator[None]:
    """A run's config is composed by Hydra alone (``ValidateRun``), which prints its
    composition errors over several lines and exits 1. Asked to raise them instead
    (HYDRA_FULL_ERROR=1 until the run starts; ``hydra_entry`` gives the user's setting
    back), the launcher says them in one line and exits 2, as for any bad input."""
    user = os.environ.get(FULL_ERROR)
    token = _USER_FULL_ERROR.set(user)
    os.environ[FULL_ERROR] = "1"
    try:
        yield
    except (HydraException, OmegaConfBaseException) as exc:
        if user == "1":
            raise
        print(f"error: {composition_error(overrides, exc)}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    finally:
        give_back_full_error()
        _USER_FULL_ERROR.reset(token)


def give_back_full_error() -> None:
    """The user's HYDRA_FULL_ERROR again, for the run itself and its ranks."""
    user = _USER_FULL_ERROR.get()
    if user is None:
        os.environ.pop(FULL_ERROR, None)
    else:
        os.environ[FULL_ERROR] = user
