"""`python -m axonn_launch [-m] key=value ...`: the Hydra application.

Before Hydra runs, a pre-flight composes every point of the command line (and for a
single run validates it) so that bad input ends with one line and exit code 2, with
nothing written or submitted. Set HYDRA_FULL_ERROR=1 for tracebacks.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from axonn_launch.config import ConfigError, compose, to_launch_config
from axonn_launch.launch import EXIT_BAD_INPUT, Outcome, launch
from axonn_launch.validate import resolve

HYDRA_FLAGS_WITHOUT_PREFLIGHT = {
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


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def hydra_entry(cfg: DictConfig) -> Outcome:
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        outcome = launch(
            to_launch_config(cfg),
            job_dir=job_dir,
            config=OmegaConf.to_container(cfg, resolve=True),
            command_line=list(sys.argv),
        )
    except ConfigError as exc:
        if not sweeping:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT) from None
        print(f"point {hydra_cfg.job.num}: invalid: {exc}", file=sys.stderr)
        shutil.rmtree(job_dir, ignore_errors=True)  # nothing kept for an invalid point
        return Outcome("invalid", "", message=str(exc))
    if not sweeping and outcome.exit_code:
        raise SystemExit(outcome.exit_code)  # Hydra does not pass the return value on
    return outcome


class SweepSummary(Callback):
    """Collects each sweep point's outcome and prints one table at the end.

    Hydra builds one instance for the jobs and another for the end of the multirun,
    so the rows are kept per sweep directory on the class.
    """

    rows: dict[str, list[tuple[str, Outcome]]] = {}

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        outcome = job_return.return_value if job_return.status.name == "COMPLETED" else None
        if outcome is None:
            outcome = Outcome("failed", "", message=str(job_return._return_value))
        key = str(config.hydra.sweep.dir)
        self.rows.setdefault(key, []).append((" ".join(job_return.overrides), outcome))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        rows = self.rows.pop(str(config.hydra.sweep.dir), [])
        print(format_table(rows))
        if any(o.exit_code for _, o in rows):
            raise SystemExit(1)


def format_table(rows: list[tuple[str, Outcome]]) -> str:
    header = ("#", "point", "status", "job id", "nodes", "job dir / reason")
    body = [
        (
            str(i),
            point or "(defaults)",
            o.status,
            o.job_id or "-",
            str(o.nodes or "-"),
            o.job_dir or o.message,
        )
        for i, (point, o) in enumerate(rows)
    ]
    widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header) - 1)]
    lines = []
    for row in [header, *body]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths)] + [row[-1]]
        lines.append("  ".join(cells))
    return "\n".join(["sweep summary:", *lines])


VALUE_FLAGS = {
    "--config-dir",
    "-cd",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--experimental-rerun",
}


def split_argv(argv: list[str]) -> tuple[list[str], dict[str, str], set[str]]:
    """Hydra's command line as (overrides, flags with values, bare flags)."""
    overrides, valued, bare = [], {}, set()
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if arg.startswith("-") and name in VALUE_FLAGS:
            valued[name] = value if eq else next(args, "")
        elif arg.startswith("-"):
            bare.add(name)
        else:
            overrides.append(arg)
    return overrides, valued, bare


def preflight(argv: list[str]) -> None:
    """Compose each point of the command line; validate it too when not sweeping."""
    overrides, valued, bare = split_argv(argv)
    if bare & HYDRA_FLAGS_WITHOUT_PREFLIGHT or {
        "--config-path",
        "-cp",
        "--config-name",
        "-cn",
        "--experimental-rerun",
    } & set(valued):
        return  # Hydra's own reports, or another primary config: Hydra checks those
    sweeping = bool(bare & {"-m", "--multirun"})
    overrides = [
        o for o in overrides if not o.startswith("hydra.") or o.startswith("hydra.searchpath")
    ]
    config_dir = valued.get("--config-dir") or valued.get("-cd")
    if config_dir:
        overrides.append(f"hydra.searchpath=[file://{os.path.abspath(config_dir)}]")
    for point in expand_sweep(overrides) if sweeping else [overrides]:
        cfg = to_launch_config(compose(point))
        if not sweeping:
            resolve(cfg)


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """The points of a basic-sweeper sweep: the product of every swept value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:
        raise ConfigError(f"bad override: {str(exc).splitlines()[0]}") from exc
    choices = []
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            choices.append([f"{key}={v}" for v in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(point) for point in itertools.product(*choices)]


def main() -> None:
    try:
        preflight(sys.argv[1:])
    except ConfigError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    hydra_entry()
