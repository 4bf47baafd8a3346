"""Sweeps (``-m``): the points the argument check (``cli.check_arguments``) covers, the
objective a point returns to a sweeper that optimizes, and the summary table at the end.

Each point's outcome is written to ``<sweep dir>/points/<num>.json`` where it ran, so any
Hydra launcher works; the summary is read back from there.

Launchers, optimizing sweepers and the objective: ``docs/launch.md`` ("submit/sweep.py").
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from axonn_launch.common.jobdir import read_record_or_empty, read_summary
from axonn_launch.config.compose import ConfigError, LaunchConfig
from axonn_launch.records.jobdirs import RunResults, run_results
from axonn_launch.submit import pack
from axonn_launch.submit.pipeline import Outcome
from axonn_launch.submit.summary import command_path, plural

log = logging.getLogger(__name__)

# summary.json key -> the direction an optimizer should take it
OBJECTIVES = {"val_loss": "minimize", "final_loss": "minimize", "tokens_per_s": "maximize"}


@dataclasses.dataclass(frozen=True)
class PointOutcome(Outcome):
    """A point's outcome; its ``float()`` is the objective that optimizing sweepers read
    (a ValueError when the job gave none: the sweeper records a failed trial)."""

    objective: str = "final_loss"
    value: float | None = None

    def __float__(self) -> float:
        if self.value is None:
            raise ValueError(f"no {self.objective}: {self.status} {self.message}".strip())
        return self.value


def check_objective(cfg: LaunchConfig, *, optimizing: bool = False) -> None:
    """A known objective; one an optimizing sweeper reads must be one the job gives."""
    if cfg.objective not in OBJECTIVES:
        raise ConfigError(f"objective={cfg.objective!r}: valid: {', '.join(OBJECTIVES)}")
    if optimizing and cfg.objective == "val_loss" and cfg.train.eval_batches < 1:
        raise ConfigError(
            "objective=val_loss needs a validation loss: train.eval_batches=0; set it to 1 or"
            " more, or choose objective=final_loss"
        )


def for_sweeper(cfg: LaunchConfig, sweeper: str) -> LaunchConfig:
    """The point's config as ``sweeper`` (its short name; 'basic' for Hydra's) needs it."""
    check_objective(cfg, optimizing=sweeper != "basic")
    if sweeper == "basic":
        return cfg
    if cfg.wait is False:
        raise ConfigError(
            f"wait=false: the {sweeper} sweeper needs each job's {cfg.objective}, so every"
            " job is waited for; drop wait=false"
        )
    return dataclasses.replace(cfg, wait=True)


def sweeper_name(target: str) -> str:
    """The sweeper's short name, as in hydra/sweeper=NAME: OptunaSweeper -> optuna."""
    return target.rsplit(".", 1)[-1].lower().removesuffix("sweeper")


def direction_warning(objective: str, direction: Any) -> str | None:
    """A warning when the sweeper optimizes ``objective`` the wrong way round."""
    want = OBJECTIVES.get(objective)
    if isinstance(direction, str) and want and direction.lower() != want:
        return f"objective={objective} should be {want}d, but hydra.sweeper.direction={direction}"
    return None


def with_objective(outcome: Outcome, objective: str) -> PointOutcome:
    """The outcome and its objective, read from the finished job's summary.json."""
    return PointOutcome(
        **dataclasses.asdict(outcome),
        objective=objective,
        value=objective_value(outcome, objective),
    )


def objective_value(outcome: Outcome, objective: str) -> float | None:
    if outcome.status != "completed":
        return None
    value = (read_summary(outcome.job_dir) or {}).get(objective)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


# --------------------------------------------------------------------------- argument check


def expand_sweep(overrides: list[str], *, interval_ends: bool = False) -> list[list[str]]:
    """The points to check before the sweep runs: every value of each choice, range and
    glob sweep (their product), and of each interval sweep (``interval(a,b)``,
    ``tag(log, interval(a,b))``), whose values only its sweeper picks, the lower end, or
    both ends with ``interval_ends``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:
        raise ConfigError(f"bad override: {str(exc).splitlines()[0]}") from exc
    choices = []
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices.append([override.input_line])
        elif override.is_discrete_sweep():
            choices.append([f"{key}={v}" for v in override.sweep_string_iterator()])
        else:
            interval = override.value()
            ends = (interval.start, interval.end) if interval_ends else (interval.start,)
            choices.append([f"{key}={sample(end)}" for end in ends])
    return [list(point) for point in itertools.product(*choices)]


def sample(start: float) -> int | float:
    """Hydra reads interval ends as floats: 1.0 is sampled as 1, valid for int keys too."""
    return int(start) if float(start).is_integer() else start


# --------------------------------------------------------------------------- summary


class SweepSummary(Callback):
    """Records each point's outcome where it ran; prints one table at the end of the
    sweep and exits 1 if any point was invalid or failed."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        record = point_record(job_return, int(config.hydra.job.num))
        path = Path(config.hydra.sweep.dir) / "points" / f"{record['num']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(path)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        pack.submit_packs(sweep_dir.resolve(), out=sys.stdout)  # a packed sweep's points
        rows = read_points(sweep_dir)
        table = format_table(rows)
        print(f"{table}\n{next_line(rows, sweep_dir)}")
        sys.stdout.flush()
        (sweep_dir / "summary.txt").write_text(table + "\n")
        if any(Outcome(row["status"], "").exit_code for row in rows):
            raise SystemExit(1)


def point_record(job_return: Any, num: int) -> dict:
    if job_return.status.name == "COMPLETED":
        outcome = job_return.return_value
    else:  # the task raised: Hydra keeps the exception as the return value
        outcome = Outcome("failed", "", message=str(job_return._return_value))
    if not isinstance(outcome, PointOutcome):
        outcome = PointOutcome(**dataclasses.asdict(outcome))
    return {"num": num, "point": " ".join(job_return.overrides), **dataclasses.asdict(outcome)}


def read_points(sweep_dir: Path) -> list[dict]:
    paths = (sweep_dir / "points").glob("*.json")
    return sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["num"])


def format_table(rows: list[dict]) -> str:
    """One row per point: its status, its grid and the planner's predicted seconds per step
    (``pred s``: ``-`` where none applies, e.g. CPU ranks), then what it measured."""
    objectives = sorted({r["objective"] for r in rows if r["value"] is not None})
    header = ("#", "point", "status", "job id", "nodes", "grid (d,x,y,z)", "pred s", "loss",
              "tok/s", "step s", *objectives, "job dir / reason")  # fmt: skip
    body = [
        (
            str(r["num"]),
            r["point"] or "(defaults)",
            r["status"],
            r["job_id"] or "-",
            str(r["nodes"] or "-"),
            *_plan_cells(r["job_dir"]),
            *_results_cells(r["job_dir"]),
            *[
                f"{r['value']:.6g}" if r["objective"] == o and r["value"] is not None else "-"
                for o in objectives
            ],  # fmt: skip
            r["job_dir"] or r["message"],
        )
        for r in rows
    ]
    widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header) - 1)]
    lines = []
    for row in [header, *body]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths)] + [row[-1]]
        lines.append("  ".join(cells))
    return "\n".join(["sweep summary:", *lines])


def next_line(rows: list[dict], sweep_dir: Path) -> str:
    """What to do after the table: fix the invalid points; submit a dry run for real; follow
    the points' jobs and compare them (``jobs status`` and ``report`` take a sweep dir)."""
    python, where = (shlex.quote(command_path(p)) for p in (sys.executable, str(sweep_dir)))
    status = f"{python} -m axonn_launch.jobs status {where}"
    report = f"{python} -m axonn_launch.report {where}"
    bad = [str(r["num"]) for r in rows if r["status"] in ("invalid", "failed", "refused")]
    rest = [r for r in rows if str(r["num"]) not in bad]
    if rest and all(r["status"] == "dry_run" for r in rest):
        then = f"the same command without dry_run=true submits {plural(len(rest), 'point')}"
    elif any(r["status"] == "submitted" for r in rest):
        then = f"{status}  (once they ran: {report})"
    else:
        then = f"{report}; {status}"
    if bad:
        fix = f"fix or leave out point {', '.join(bad)} (its reason is in the table)"
        return f"next: {fix}; then {then}" if rest else f"next: {fix}"
    return f"next: {then}"


def _plan_cells(job_dir: str) -> tuple[str, str]:
    """The point's grid and predicted s/step, from its job.json ("-" where absent)."""
    record = read_record_or_empty(job_dir) if job_dir else {}
    grid = record.get("grid")
    shown = f"({grid['data']},{grid['x']},{grid['y']},{grid['z']})" if grid else "-"
    predicted = record.get("predicted_step_s")
    return shown, "-" if predicted is None else f"{predicted:.3g}"


def _results_cells(job_dir: str) -> tuple[str, str, str]:
    """Loss, tokens/s and step time of a point's job, so far ("-" before its first step)."""
    results = run_results(Path(job_dir)) if job_dir else RunResults()
    cells = (
        (results.loss, "{:.4f}"),
        (results.tokens_per_s, "{:.0f}"),
        (results.step_time_s, "{:.3g}"),
    )
    return tuple("-" if value is None else form.format(value) for value, form in cells)
