"""The launcher's typed config (``LaunchConfig`` and its parts) and the builder that checks a
composed tree's keys and types into it. Errors are ``ConfigError`` with a one-line message
naming the field, the value and what would be valid."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from axonn_launch.common.machine import MachineProfile
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import GenerateConfig, MemorizationConfig, TrainConfig
from axonn_launch.common.tracking import MetricsConfig


class ConfigError(ValueError):
    """A bad input, reported as one line; nothing has been submitted or written."""


@dataclass(frozen=True)
class GridRequest:
    """The grid as asked for: unset axes are None; ``auto`` asks the planner."""

    data: int | None = None
    x: int | None = None
    y: int | None = None
    z: int | None = None
    auto: bool = False
    pick: int = 0  # with auto: 0 = the planner's best, k = its (k+1)-th best

    def given(self) -> bool:
        return any(getattr(self, a) is not None for a in ("data", "x", "y", "z"))


@dataclass(frozen=True)
class Site:
    accounts: dict[str, str] = field(default_factory=dict)
    scratch: str = ""


def account_override(site: Site, machine: str) -> str:
    """The override that sets ``machine``'s account: ``site.accounts.NAME=`` where the site
    config lists the machine, else ``+site.accounts.NAME=`` (Hydra adds a key only with +)."""
    return f"{'' if machine in site.accounts else '+'}site.accounts.{machine}"


@dataclass(frozen=True)
class RecoveryConfig:
    """How a failed attempt is brought back (conf/recovery/, batch/recovery.py)."""

    mode: str = "auto"  # auto: on for Slurm machines, off for local; on: every machine; off
    # class -> resume|resume_exclude|stop (and rollback for non_finite)
    policy: dict[str, str] = field(default_factory=dict)
    max_attempts: int = 5
    max_same_class: int = 3
    max_no_progress: int = 3  # attempts in a row whose checkpointed step did not advance
    exclude_stragglers: bool = False  # also leave out the nodes stragglers.json names
    backoff_s: float = 30.0
    budget_h: float = 0.0  # 0: no wall-clock budget
    on_fewer_nodes: str = "shrink"  # shrink | wait | stop
    notify: str = ""  # a command: <notify> <run dir> <state>
    in_job_restarts: int = 2  # a failed step run again inside its Slurm job (submit/in_job.py)
    spare_nodes: int = 0  # nodes asked beyond the grid's, taken by a restart in place


@dataclass(frozen=True)
class SweepConfig:
    """How a multirun's points use the scheduler (``submit/pack.py``)."""

    pack: str = "off"  # off | auto | <nodes>: points share allocations of that many nodes
    pack_time_min: int | None = None  # a pack's time limit; None: the machine's for its nodes
    array_limit: int = 0  # sweep.pack=array: tasks running at once (--array=...%N); 0: any


@dataclass(frozen=True)
class LaunchConfig:
    name: str
    machine: MachineProfile
    model: ModelSpec
    grid: GridRequest
    train: TrainConfig
    nodes: int | None = None
    dry_run: bool = False
    show_config: bool = False  # a dry run also prints the resolved config (summary.dry_run_text)
    wait: bool | None = None
    max_requeue: int = 3
    force: bool = False  # launch beside an identical queued or running job (submit/duplicates.py)
    resume: bool = False  # continue its job dir's run as a new attempt (submit/dirguard.py)
    site: Site = field(default_factory=Site)
    objective: str = "val_loss"  # what a sweep point returns to an optimizer (sweep.py)
    # check GEMM speed, bandwidth and network plugin in the allocation before training
    # (train/health/preflight.py); None = the machine's default: on for Slurm machines
    preflight: bool | None = None
    # copy the package into the job dir at submission, and have every attempt import that
    # copy (records/provenance.py); None = on for Slurm machines. Off on this computer: a
    # local job's supervisor has imported the installed package before the job is composed
    code_snapshot: bool | None = None
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    memorization: MemorizationConfig = field(default_factory=MemorizationConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # curves (common/tracking.py)
    # run this site machine's batch script on the local Slurm cluster (rehearse.py)
    rehearse: bool = False
    # rehearse=rank: this rank of the job runs here with fake collectives, after a dry run
    # (submit/rank_rehearsal.py); None: no rank rehearsal
    rehearse_rank: int | None = None
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    # auto: inside a held Slurm allocation (salloc), run as its step; new: submit a new job
    # (submit/allocation.py)
    allocation: str = "auto"
    sweep: SweepConfig = field(default_factory=SweepConfig)


ALLOCATIONS = ("auto", "new")


def build(cls: type, raw: Any, path: str) -> Any:
    """Build dataclass ``cls`` from plain data, checking keys and types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}={raw!r}: expected a mapping of keys")
    hints = field_types(cls)
    for key in raw:
        if key not in hints:
            where = f"{path}.{key}" if path else str(key)
            names = list(hints)
            hint = did_you_mean(str(key), names, prefix=f"{path}." if path else "")
            raise ConfigError(f"{where}: unknown key;{hint} valid keys here: {', '.join(names)}")
    values = {}
    for name, kind in hints.items():
        if name in raw:
            where = f"{path}.{name}" if path else name
            values[name] = convert(kind, raw[name], where)
    try:
        return cls(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Each field of dataclass ``cls`` -> its type, in field order (read once per class: a
    sweep builds a config per point)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# what turns off a section that has an ``enabled`` key, given as its whole value
SWITCHED_OFF = ("off", False)

# Keys whose ``auto`` is None in the dataclass (the launcher resolves it), with what is valid
AUTO_KEYS = {
    "machine.slurm.time_min": "minutes >= 1, or auto (the longest the profile's"
    " slurm.time_bins allow for the job's nodes)",
    "train.checkpoint_every": "a number of steps >= 0 (0: only at the end and on a requeue"
    " signal) or auto (Young/Daly's interval, cost/expected_goodput.py)",
}


def convert(kind: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if path in AUTO_KEYS:
            return convert_auto(value, path)
        (inner,) = [a for a in args if a is not type(None)]
        return convert(inner, value, path)
    if dataclasses.is_dataclass(kind):
        if value in SWITCHED_OFF and "enabled" in {f.name for f in dataclasses.fields(kind)}:
            return kind(enabled=False)  # e.g. train.watchdog=off
        return build(kind, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}={value!r}: expected a list")
        return [convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r}: expected a mapping")
        return {str(k): convert(args[1], v, f"{path}.{k}") for k, v in value.items()}
    return convert_scalar(kind, value, path)


def convert_auto(value: Any, path: str) -> int | None:
    """An integer, or ``auto`` (None: the launcher resolves it), for a key of ``AUTO_KEYS``."""
    if value == "auto":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{path}={value!r}: expected {AUTO_KEYS[path]}")


def convert_scalar(kind: type, value: Any, path: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={value!r}: expected true or false")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={value!r}: expected an integer")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}={value!r}: expected a number")
    if kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}={value!r}: expected a string")
    raise ConfigError(f"{path}: unsupported type {kind!r}")


def did_you_mean(word: str, options: list[str], prefix: str = "") -> str:
    """`` did you mean PREFIXOPTION?`` for the option nearest to a misspelled ``word``,
    else ``""``: a typo is answered with its fix, not only with the list to search."""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" did you mean {prefix}{close[0]}?" if close else ""


def first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__
