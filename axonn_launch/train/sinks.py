"""Rank 0's metric sinks besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

``open_sinks`` opens those ``metrics.sinks`` names (``common.tracking.SINKS``: a new sink
is one module with an opener and one ``register_sink`` line there) in the run's root dir,
so that every attempt of a run (a requeue, a recovery attempt ``<dir>_attempt<N>``) adds to one
TensorBoard folder and resumes one W&B run. TensorBoard gets every row as it is logged and
starts each attempt with a purge at its first step (no step twice in the stream); W&B gets
only final rows (a published checkpoint covers them), so no step is sent twice. A sink that
cannot open or fails logs one line and is dropped: training goes on. Design and sources:
docs/job-side.md ("Curves").
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from axonn_launch.common.jobdir import (
    JobPaths,
    checkpointed_step,
    metrics_through,
    read_json_or_none,
    read_record_or_empty,
    run_root,
    write_json_atomically,
)
from axonn_launch.common.spec import JobSpec
from axonn_launch.common.tracking import SINKS, WandbConfig

log = logging.getLogger(__name__)

SCALARS = ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu",
           "mem_gb", "val_loss")  # fmt: skip
FLUSH_S = 10  # TensorBoard's writer flushes this often, and at every checkpoint


def scalars(row: dict, predicted_step_s: float | None = None) -> dict[str, float]:
    """A metrics row's numbers (``None``s left out), its stragglers counted, and the
    planner's step time beside the measured one."""
    found = {k: float(row[k]) for k in SCALARS if isinstance(row.get(k), int | float)}
    if row.get("stragglers"):
        found["stragglers"] = float(len(row["stragglers"]))
    if predicted_step_s:
        found["predicted_step_time_s"] = float(predicted_step_s)
    return found


def summary_scalars(summary: dict) -> dict[str, float]:
    """The summary's throughput and final loss (its stragglers are a report, not a row's)."""
    row = {k: v for k, v in summary.items() if k != "stragglers"}
    return scalars(row | {"loss": summary.get("final_loss")})


def numbers_in(value: object, prefix: str) -> dict[str, float]:
    """Every number of a nested record (preflight.json), keyed by its path."""
    if isinstance(value, dict):
        found: dict[str, float] = {}
        for key, item in value.items():
            found |= numbers_in(item, f"{prefix}/{key}")
        return found
    if isinstance(value, int | float) and not isinstance(value, bool):
        return {prefix: float(value)}
    return {}


class TensorBoardSink:
    """Event files in the run's ``tensorboard/`` folder, the step as x axis."""

    name = "tensorboard"

    def __init__(self, folder: Path, *, start_step: int, attempt: int, predicted: float | None,
                 preflight: dict | None = None) -> None:  # fmt: skip
        from torch.utils.tensorboard import SummaryWriter

        # readers drop whatever an earlier attempt logged from this step on
        self.writer = SummaryWriter(str(folder), purge_step=start_step + 1, flush_secs=FLUSH_S)
        self.attempt, self.predicted, self.first = attempt, predicted, True
        for tag, value in numbers_in(preflight or {}, "preflight").items():
            self.writer.add_scalar(tag, value, start_step)

    def log(self, row: dict) -> None:
        step = row["step"]
        if self.first:
            self.writer.add_scalar("attempt", self.attempt, step)
            self.first = False
        for tag, value in scalars(row, self.predicted).items():
            self.writer.add_scalar(tag, value, step)

    def checkpointed(self, step: int) -> None:
        self.writer.flush()

    def close(self, summary: dict | None) -> None:
        if summary:
            for tag, value in summary_scalars(summary).items():
                self.writer.add_scalar(f"summary/{tag}", value, summary["steps"])
        self.writer.close()


class WandbSink:
    """One W&B run per run, resumed by every attempt, and fed only final rows (those a
    published checkpoint covers, or the finished run's): the ones no attempt redoes. What
    the run already holds is the server's word online (``run.starting_step``), and offline
    the root's tracker.json, written once ``finish()`` has saved the attempt's rows; an
    attempt first sends the rows before its checkpoint the run lacks (its metrics.jsonl)."""

    name = "wandb"

    def __init__(self, cfg: WandbConfig, root: Path, *, job_dir: Path, run_name: str,
                 attempt: int, start_step: int, config: dict) -> None:  # fmt: skip
        import wandb

        # a wandb-core service named by an inherited WANDB_SERVICE (a parent that ran wandb)
        # outlives a killed attempt and keeps its run id open: the next attempt could not
        # resume it. This process starts its own, which ends with it.
        os.environ.pop("WANDB_SERVICE", None)
        self.tracker = Tracker(root)
        self.tracker.started(attempt, start_step)
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity or None, group=cfg.group or None,
            mode=cfg.mode, dir=str(root), id=self.tracker.wandb_id(), resume="allow",
            name=run_name, settings=wandb.Settings(silent=True, console="off"),
        )  # fmt: skip
        self.run.config.update(config, allow_val_change=True)  # a shrink changes the grid
        self.online, self.job_dir = cfg.mode == "online", job_dir
        held = self.run.starting_step - 1 if self.online else self.tracker.get("wandb_through", 0)
        self.sent = max(int(held), 0)
        self.rows = [row for row in earlier_rows(job_dir, start_step) if row["step"] > self.sent]

    def log(self, row: dict) -> None:
        self.rows.append(row)

    def checkpointed(self, step: int) -> None:
        if self.online:  # live curves; offline, nobody looks before the attempt ends
            self.send(checkpointed_step(self.job_dir))

    def send(self, through: int) -> None:
        ready = [row for row in self.rows if self.sent < row["step"] <= through]
        self.rows = [row for row in self.rows if row["step"] > through]
        for row in ready:
            attempt = self.tracker.attempt_of(row["step"])
            self.run.log(scalars(row) | {"attempt": attempt}, step=row["step"])
        self.sent = max(self.sent, through)

    def close(self, summary: dict | None) -> None:
        # a finished run's last save is published (run.py waits for it before the summary)
        self.send(summary["steps"] if summary else checkpointed_step(self.job_dir))
        if summary:
            self.run.summary.update(summary_scalars(summary))
        self.run.finish(exit_code=0 if summary else 1)
        self.tracker.update(wandb_through=self.sent)


def earlier_rows(job_dir: Path, start_step: int) -> list[dict]:
    """The rows of metrics.jsonl up to the checkpoint this attempt resumed from (a line
    cut off mid-write, by a disk that filled before lines were written whole, is skipped
    with a warning)."""
    lines, cut = metrics_through(JobPaths(job_dir).metrics, start_step)
    if cut:
        log.warning("metrics.jsonl: skipped %d line(s) cut off mid-write", cut)
    return [json.loads(line) for line in lines]


class Tracker:
    """The run root's tracker.json: the W&B id, the last step the W&B run holds (offline),
    and the step each attempt started from (what marks a row's attempt). Rank 0 of one
    attempt at a time writes it."""

    def __init__(self, root: Path) -> None:
        self.path = JobPaths(root).tracker
        kept = read_json_or_none(self.path)
        self.record = kept if isinstance(kept, dict) else {}

    def get(self, key: str, default: object = None) -> object:
        return self.record.get(key, default)

    def update(self, **values: object) -> None:
        self.record |= values
        write_json_atomically(self.path, self.record)

    def wandb_id(self) -> str:
        """Made by the run's first attempt, read by every later one."""
        if not isinstance(self.record.get("wandb_id"), str):
            self.update(wandb_id=uuid.uuid4().hex[:12])
        return self.record["wandb_id"]

    def started(self, attempt: int, start_step: int) -> None:
        self.update(starts={**self.record.get("starts", {}), str(attempt): start_step})

    def attempt_of(self, step: int) -> int:
        """The attempt that logged ``step``: the last one started before it."""
        starts = {int(a): s for a, s in self.record.get("starts", {}).items()}
        return max((a for a, s in starts.items() if s < step), default=1)


class Sinks:
    """The open sinks; a call that raises drops that sink, with one line."""

    def __init__(self, sinks: list) -> None:
        self.sinks = sinks

    def log(self, row: dict) -> None:
        self.each("log", row)

    def checkpointed(self, step: int) -> None:
        self.each("checkpointed", step)

    def close(self, summary: dict | None = None) -> None:
        self.each("close", summary)
        self.sinks = []

    def each(self, method: str, *args: object) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as error:
                log.warning("metrics sink %s failed: %s; training goes on without it",
                            sink.name, one_line(error))  # fmt: skip
                self.sinks.remove(sink)


def one_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def open_sink(name: str, opener, /, *args, **kwargs):
    """The sink ``opener`` makes, or None and one line saying why not."""
    try:
        return opener(*args, **kwargs)
    except ImportError as error:
        extra = f" (pip install -e '.[{name}]')" if name == "wandb" else ""
        log.warning("metrics sink %s: %s is not installed%s; training goes on without it",
                    name, error.name or name, extra)  # fmt: skip
    except Exception as error:
        log.warning("metrics sink %s: cannot open: %s; training goes on without it",
                    name, one_line(error))  # fmt: skip
    return None


@dataclass(frozen=True)
class SinkOpening:
    """What a sink's opener (``common.tracking.MetricSink.opener``) is given."""

    spec: JobSpec
    root: Path  # the run's root dir: every attempt's sinks open there
    start_step: int
    attempt: int
    predicted: float | None  # the planner's step time (s), if it made one


def open_sinks(spec: JobSpec, *, start_step: int, attempt: int, enabled: bool) -> Sinks:
    """Rank 0's sinks (``enabled``), each ``metrics.sinks`` name's registered opener called
    in the run's root dir; none on other ranks."""
    if not enabled:
        return Sinks([])
    record = read_record_or_empty(spec.job_dir)
    root, predicted = run_root(spec.job_dir, record), record.get("predicted_step_s")
    opening = SinkOpening(spec, root, start_step, attempt, predicted)
    openers = [SINKS[name].opener for name in spec.metrics.sinks if SINKS[name].opener]
    opened = [opener_of(path)(opening) for path in openers]
    return Sinks([sink for sink in opened if sink is not None])


def opener_of(path: str) -> Callable[[SinkOpening], object | None]:
    """The function ``"module:function"`` names."""
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)


def open_tensorboard(at: SinkOpening) -> TensorBoardSink | None:
    preflight = read_json_or_none(JobPaths(at.spec.job_dir).preflight)
    return open_sink(
        "tensorboard", TensorBoardSink, JobPaths(at.root).tensorboard, start_step=at.start_step,
        attempt=at.attempt, predicted=at.predicted,
        preflight=preflight if isinstance(preflight, dict) else None,
    )  # fmt: skip


def open_wandb(at: SinkOpening) -> WandbSink | None:
    spec = at.spec
    config = asdict(spec) | {"predicted_step_s": at.predicted, "attempt": at.attempt}
    return open_sink(
        "wandb", WandbSink, spec.metrics.wandb, at.root, run_name=spec.name,
        job_dir=Path(spec.job_dir), attempt=at.attempt, start_step=at.start_step, config=config,
    )  # fmt: skip
