"""Measure what the planner assumes: collective bandwidths per group layout, GEMM speed.

The command, torch-free: its settings, what to measure (``Plan``) and how to read the
times; the measuring itself, which imports torch, is ``train/health/calibrate.py``,
imported only once the command runs. ``python -m axonn_launch.calibrate --help`` shows
how to run it; ``python -m axonn_launch.plan ... calibration=FILE`` uses its file.

What is measured and how the ring model is fitted: ``docs/cost-model.md``
("calibrate.py").
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from axonn_launch import scheduler
from axonn_launch.common.ranks import rank_source
from axonn_launch.config.compose import machine_choices
from axonn_launch.cost.perf import (
    ALL_REDUCE,
    Gemm,
    planned_gemms,
)
from axonn_launch.usage import help_page, run_tool, wants_help


class CalibrateError(ValueError):
    """A user's mistake or a missing allocation: one line, exit code 2."""


@dataclass(frozen=True)
class Settings:
    machine: str = "local"
    output: str = ""  # default: jobs/calibrate-<machine>/<time>/calibration-<machine>.json
    nproc: int = 0  # >0: spawn this many local processes (gloo) instead of joining a job
    small_bytes: int = 64 * 1024
    large_bytes: int = 0  # 0: 64 MiB on GPUs, 4 MiB on CPUs
    reps: int = 5
    warmup: int = 2
    block_seconds: float = 0.05  # length of one timed block of GEMM or element-wise calls
    gpus_per_node: int = 0  # 0: the machine profile's (local: nproc)
    model: str = ""  # a model preset: also time its GEMMs at the planned grids' shapes
    nodes: int = 0  # nodes of the job to plan those grids for; 0: this allocation's
    global_batch: int = 0  # that job's global batch; 0: the preset's
    gemm_grids: int = 4  # how many of the planner's best grids' GEMM shapes to time

    def output_path(self) -> Path:
        if self.output:
            return Path(self.output)
        when = time.strftime("%Y-%m-%d_%H-%M-%S")
        return Path("jobs", f"calibrate-{self.machine}", when, f"calibration-{self.machine}.json")


KEY_HELP = {
    "machine=NAME": f"machine profile: {machine_choices()}",
    "out=FILE": "the file to write (or output=); default jobs/calibrate-<machine>/<time>/",
    "nproc=N": "start this many local gloo processes instead of joining srun's tasks",
    "small_bytes=BYTES": "smallest message of each collective (default 64 KiB)",
    "large_bytes=BYTES": "largest message (default 64 MiB on GPUs, 4 MiB on CPUs)",
    "reps=N": "repetitions of each timing; the best counts (default 5)",
    "warmup=N": "untimed calls before each timing (default 2)",
    "block_seconds=S": "length of one timed block of GEMMs or element-wise adds (default 0.05)",
    "gpus_per_node=N": "ranks per node (default: the machine profile's; local: nproc)",
    "model=NAME": "also time every layout of this model's GEMMs at its planned grids' shapes",
    "nodes=N": "plan those grids for N nodes (default: the nodes of this allocation)",
    "global_batch=N": "...and this global batch (default: the model preset's)",
    "gemm_grids=K": "time the GEMM shapes of the planner's K best grids (default 4)",
}
ALIASES = {"out": "output"}


@dataclass(frozen=True)
class Layout:
    size: int
    stride: int
    per_node: int

    def groups(self, world: int) -> list[list[int]]:
        """Partition of the world into groups of ``size`` ranks ``stride`` apart."""
        span = self.size * self.stride
        return [
            [block + offset + i * self.stride for i in range(self.size)]
            for block in range(0, world, span)
            for offset in range(self.stride)
        ]


def layouts(world: int, gpus_per_node: int) -> list[Layout]:
    """One layout per distinct (size, ranks per node) a grid axis can have."""
    found: dict[tuple[int, int], Layout] = {}
    size = 2
    while size <= world:
        stride = 1
        while size * stride <= world:
            if size * stride <= gpus_per_node:
                per_node = size
            else:
                per_node = max(1, min(size, gpus_per_node // stride))
            found.setdefault((size, per_node), Layout(size, stride, per_node))
            stride *= 2
        size *= 2
    return list(found.values())


def fit_ring(collective: str, p: int, sizes: tuple[float, ...], times: tuple[float, ...]):
    """(bus GB/s, alpha in us) fitted to timings at several sizes by least squares.

    The ring model of perf.ring_time is a line in the message size M:
    t = steps * alpha + factor * M / B. A non-positive slope (noise) falls back to the
    largest message alone with alpha = 0.
    """
    steps, factor = (
        (2 * (p - 1), 2 * (p - 1) / p) if collective == ALL_REDUCE else (p - 1, (p - 1) / p)
    )
    xs = [factor * m for m in sizes]
    mx, my = statistics.fmean(xs), statistics.fmean(times)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - my) for x, t in zip(xs, times, strict=True)) / sxx
    if slope <= 0:
        return xs[-1] / times[-1] / 1e9, 0.0
    alpha = max(0.0, (my - slope * mx) / steps)
    return 1 / slope / 1e9, alpha * 1e6


# --------------------------------------------------------------------------- what to measure


@dataclass(frozen=True)
class Plan:
    """What the measuring half (``train/health/calibrate.py``) times and how its numbers
    are read, torch-free; pickled to the local processes ``run_local`` spawns."""

    settings: Settings
    gpus_per_node: int

    def layouts(self, world: int) -> list[Layout]:
        return layouts(world, self.gpus_per_node)

    def gemm_shapes(self, world: int) -> tuple[list[Gemm], str]:
        return gemm_shapes_to_measure(self.settings, world, self.gpus_per_node)

    def fit(
        self, collective: str, p: int, sizes: tuple[float, ...], times: tuple[float, ...]
    ) -> tuple[float, float]:
        return fit_ring(collective, p, sizes, times)

    def finish(self, result: dict[str, Any] | None) -> None:
        _finish(self.settings, result)


def gemm_shapes_to_measure(
    settings: Settings, world: int, gpus_per_node: int
) -> tuple[list[Gemm], str]:
    """The distinct GEMM shapes (``perf.planned_gemms``) of the planner's
    ``gemm_grids`` best grids for ``settings.model`` on ``settings.nodes`` nodes (default:
    this allocation's), and a line naming them; none without a model. Torch-free: every
    rank computes the same list."""
    if not settings.model:
        return [], ""
    from axonn_launch.config.compose import load
    from axonn_launch.cost.planner import plan

    overrides = [f"machine={settings.machine}", f"model={settings.model}"]
    if settings.global_batch:
        overrides.append(f"train.global_batch={settings.global_batch}")
    cfg = load(overrides)
    if settings.machine == "local":  # one node of nproc ranks, as in run_local
        hw = replace(cfg.machine.hardware, gpus_per_node=gpus_per_node)
        cfg = replace(cfg, machine=replace(cfg.machine, hardware=hw))
    nodes = settings.nodes or max(1, world // max(1, cfg.machine.hardware.gpus_per_node))
    rows = plan(machine=cfg.machine, model=cfg.model, train=cfg.train, nodes=nodes,
                top=settings.gemm_grids)  # fmt: skip
    shapes: dict[tuple, Gemm] = {}
    for row in rows:
        train = replace(cfg.train, micro_batch=row.micro_batch)
        for g in planned_gemms(cfg.model, row.grid, train):
            shapes.setdefault(g.key, g)
    grids = ", ".join(f"({r.grid.describe()} mb={r.micro_batch})" for r in rows)
    return sorted(shapes.values(), key=lambda g: g.key), f"{nodes} node(s): {grids}"


# --------------------------------------------------------------------------- running

INSTEAD = "run it inside salloc with srun, one task per GPU, or use machine=local nproc=4"


def run_in_allocation(settings: Settings) -> None:
    """Join the job's world (srun / torchrun / mpirun variables) and measure. Outside any
    task of a cluster machine it ends before torch is imported (``outside_a_task``)."""
    from axonn_launch.common.spec import RuntimeConfig
    from axonn_launch.config.compose import load

    machine = load([f"machine={settings.machine}"]).machine
    problem = outside_a_task(scheduler.of(machine).on_this_computer, os.environ)
    if problem:
        raise CalibrateError(f"calibrate machine={settings.machine}: {problem}; {INSTEAD}")
    from axonn_launch.train.health import calibrate as measuring

    env = measuring.join(RuntimeConfig(backend=machine.backend, device_index=machine.device_index))
    problem = measuring.world_problem(env)
    if problem:
        raise CalibrateError(f"calibrate machine={settings.machine}: {problem}; {INSTEAD}")
    gpn = settings.gpus_per_node or machine.hardware.gpus_per_node or env.local_world_size
    measuring.measure_in_world(env, Plan(settings, gpn))


def outside_a_task(on_this_computer: bool, environ: Mapping[str, str]) -> str | None:
    """Why a machine with a scheduler cannot be calibrated from this process: no launcher
    (srun, torchrun, mpirun) set its rank; None when one did, or the machine is this
    computer. Torch-free, so that a login node hears it at once."""
    if not on_this_computer and rank_source(environ) == "single":
        return "needs a GPU allocation (no srun task here)"
    return None


def run_local(settings: Settings) -> None:
    """Spawn ``settings.nproc`` gloo processes on this computer (one "node") and measure."""
    from axonn_launch.train.health import calibrate as measuring

    plan = Plan(settings, settings.gpus_per_node or settings.nproc)
    measuring.spawn_local(plan, settings.nproc, _free_port())


def _finish(settings: Settings, result: dict[str, Any] | None) -> None:
    if result is None:
        return
    path = settings.output_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"calibration of {result['world_size']} ranks written to {path}")
    print(f"use it: python -m axonn_launch.plan machine={settings.machine} calibration={path}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HELP = help_page(
    usage="python -m axonn_launch.calibrate [KEY=VALUE ...] [--debug]",
    summary=(
        "Measure what the planner assumes on this machine: all-reduce, all-gather and\n"
        "reduce-scatter bandwidth per group layout, GEMM and element-wise throughput, and how\n"
        "much communication a GEMM hides. Run it under srun, one task per GPU, inside an\n"
        "allocation; or with nproc=N local processes. Feed the file to plan calibration=FILE."
    ),
    keys=list(KEY_HELP.items()) + [("--debug", "show the traceback of an error")],
    examples=[
        "srun -N 2 --ntasks-per-node=4 python -m axonn_launch.calibrate machine=perlmutter",
        "python -m axonn_launch.calibrate machine=local nproc=4",
        "python -m axonn_launch.calibrate machine=local nproc=4 out=cal-local.json",
    ],
)


def parse_args(argv: list[str]) -> Settings:
    fields = Settings.__dataclass_fields__
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = ALIASES.get(key, key)
        if not sep or key not in fields:
            raise CalibrateError(
                f"{arg!r}: expected key=value with key in {', '.join(fields)}"
                " (python -m axonn_launch.calibrate --help)"
            )
        kind = type(fields[key].default)  # str, int or float
        try:
            values[key] = kind(value)
        except ValueError:
            raise CalibrateError(f"{key}={value!r}: expected {kind.__name__}") from None
    return Settings(**values)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(HELP)
        return 0
    from axonn_launch.config.compose import ConfigError

    return run_tool(_main, argv, (CalibrateError, ConfigError))


def _main(argv: list[str]) -> int:
    settings = parse_args(argv)
    settings = replace(settings, output=str(settings.output_path()))  # one time stamp
    if settings.nproc > 0:
        run_local(settings)
    else:
        run_in_allocation(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
