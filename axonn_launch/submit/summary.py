"""The launch summary: what will run, where, for how long, and why these nodes.

Printed on every launch and dry run (``launch.launch``) and written to the job dir's
``axonn_launch.log``. Where the machine knows a failure rate it states the checkpoint interval
(``train.checkpoint_every``, or auto's: Young/Daly) and its expected goodput
(``cost/goodput.py``). On Slurm machines it also shows the account and the wall-clock:
the time limit of one allocation, how many requeues follow it (``max_requeue``), and the
planner's predicted step time times the steps (``perf.step_time``, the same prediction
``plan`` ranks grids by, with nominal hardware numbers: no calibration file). A run that
cannot finish within ``time_min x (1 + max_requeue)`` gets a warning naming the keys.

Never imports torch: this runs on login nodes.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from axonn_launch.common.durations import duration
from axonn_launch.config.compose import LaunchConfig
from axonn_launch.config.validate import Resolved, placeholder
from axonn_launch.cost.goodput import Checkpointing
from axonn_launch.cost.memory import GIB


def summary(cfg: LaunchConfig, resolved: Resolved, job_dir: Path) -> str:
    """The lines the console and ``axonn_launch.log`` get before anything runs."""
    params = cfg.model.n_params()
    scale = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.2f} M"
    grid, train = resolved.grid, resolved.train
    note = planner_note(cfg.grid.pick) if resolved.planned else ""
    how = " (automatic)" if cfg.train.micro_batch is None else ""
    lines = [
        f"job        {cfg.name}",
        f"machine    {cfg.machine.name} ({cfg.machine.hardware.gpu_model})",
        f"model      {cfg.model.name}: {params:,} parameters ({scale})",
        f"grid       {grid.describe()} = {grid.world_size} ranks{note}",
        f"batch      global_batch={train.global_batch} = micro_batch={train.micro_batch}{how}"
        f" x grid.data={grid.data} x {train.accumulation_steps(grid)} micro-step(s)",
        f"nodes      {resolved.nodes} x {resolved.tasks_per_node} tasks:"
        f" {nodes_reason(cfg, resolved)}",
        f"memory     {memory_words(cfg, resolved)}",
    ]
    if cfg.machine.scheduler == "slurm":
        lines += slurm_lines(cfg, run_time(cfg, resolved))
    if resolved.checkpointing is not None:
        lines += checkpoint_lines(resolved.checkpointing)
    lines += [f"preflight  {preflight_words(cfg)}", f"job dir    {job_dir}"]
    return "\n".join(lines)


def nodes_reason(cfg: LaunchConfig, resolved: Resolved) -> str:
    """Where the node count came from: this computer, nodes=, the planner's search
    (``plan.smallest_nodes``, as ``plan`` without nodes=) or the grid's size."""
    if cfg.machine.scheduler == "local":
        return "this computer"
    if cfg.nodes is not None:
        return f"given (nodes={cfg.nodes})"
    if resolved.planned:
        return "the fewest where a grid fits (planner)"
    return f"from the grid ({resolved.grid.world_size} ranks / {resolved.tasks_per_node} per node)"


def memory_words(cfg: LaunchConfig, resolved: Resolved) -> str:
    """The estimate per GPU against the GPU's memory (when the profile knows it)."""
    memory = resolved.memory
    largest = memory.biggest()[0]
    capacity = cfg.machine.hardware.mem_per_gpu_gb
    if cfg.machine.hardware.gpu_model == "cpu" or capacity <= 0:
        return f"{memory.total / GIB:.2f} GiB per rank (largest: {largest})"
    used = memory.total / GIB
    return f"{used:.1f} of {capacity:g} GiB per GPU ({used / capacity:.0%}, largest: {largest})"


@dataclass(frozen=True)
class RunTime:
    """The predicted wall-clock of a Slurm run against its allocations."""

    step_s: float  # predicted seconds per optimizer step
    steps: int
    limit_min: int  # machine.slurm.time_min: one allocation
    max_requeue: int

    @property
    def total_s(self) -> float:
        return self.step_s * self.steps

    @property
    def allocations(self) -> int:
        """Allocations of ``limit_min`` the run takes (each requeue is one more)."""
        return max(1, math.ceil(self.total_s / (self.limit_min * 60)))

    @property
    def budget_s(self) -> float:
        """What the first allocation and every allowed requeue give together."""
        return self.limit_min * 60 * (1 + self.max_requeue)

    @property
    def fits(self) -> bool:
        return self.total_s <= self.budget_s


def run_time(cfg: LaunchConfig, resolved: Resolved) -> RunTime:
    """The planner's prediction for the grid, micro-batch and cache the job runs."""
    if resolved.step_time is None:
        raise ValueError("machine.hardware: no bandwidth figures to predict a step from")
    return RunTime(
        step_s=resolved.step_time.total,
        steps=resolved.train.steps,
        limit_min=cfg.machine.slurm.time_min,
        max_requeue=cfg.max_requeue,
    )


def slurm_lines(cfg: LaunchConfig, rt: RunTime) -> list[str]:
    takes = plural(rt.allocations, "allocation")
    if rt.allocations > 1:
        takes += f", {plural(rt.allocations - 1, 'requeue')}"
    return [
        f"account    {account_words(cfg)}",
        f"time limit {rt.limit_min} min (machine.slurm.time_min) x"
        f" {plural(1 + rt.max_requeue, 'allocation')} (1 + max_requeue={rt.max_requeue})"
        f" = {duration(rt.budget_s)}",
        f"predicted  {rt.step_s:.4g} s/step (planner, uncalibrated) x {rt.steps:,} steps"
        f" = {duration(rt.total_s)}: {takes}",
    ]


def checkpoint_lines(ck: Checkpointing) -> list[str]:
    """The checkpoint interval the job runs and its expected goodput (``cost/goodput.py``)."""
    daly = f"Daly's {duration(ck.optimal_s)} over {ck.step_s:.3g} s/step"
    given = f"train.checkpoint_every={ck.every}"
    if ck.auto:
        interval = f"every {plural(ck.every, 'step')} (auto: {daly})"
    elif ck.every:
        interval = f"every {plural(ck.every, 'step')} ({given}); auto: {ck.auto_steps:,} ({daly})"
    else:
        interval = f"only at the end and on a requeue signal ({given}); auto: {ck.auto_steps:,}"
    written = f"{size_words(ck.checkpoint_gb * 1e9)} at {ck.write_gbps:,.4g} GB/s"
    auto = "" if ck.auto else f" ({ck.auto_goodput:.1%} with train.checkpoint_every=auto)"
    return [
        f"checkpoint {interval}; a save {duration(ck.save_s)}"
        f" ({'measured' if ck.save_measured else written})",
        f"goodput    {ck.goodput:.1%} expected{auto}: job MTBF {duration(ck.mtbf_s)}"
        f" ({ck.node_mtbf_hours:,.4g} h per node / {plural(ck.nodes, 'node')}), restart"
        f" {duration(ck.restart_s)}",
    ]


def size_words(nbytes: float) -> str:
    """Bytes in the decimal unit a person would use."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.3g} {unit}"
    return f"{nbytes / 1e3:,.3g} kB"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def account_words(cfg: LaunchConfig) -> str:
    account = cfg.machine.slurm.account
    if account:
        return account
    if "slurm.account" in cfg.machine.required:
        return f"{placeholder('slurm.account')} (site.accounts.{cfg.machine.name}=...)"
    return "none (the cluster's default)"


def wallclock_warnings(cfg: LaunchConfig, resolved: Resolved) -> list[str]:
    """One warning when a Slurm run cannot finish in ``time_min x (1 + max_requeue)``,
    with what would make it fit; the launch still proceeds."""
    if cfg.machine.scheduler != "slurm":
        return []
    rt = run_time(cfg, resolved)
    if rt.fits:
        return []
    steps_that_fit = int(rt.budget_s // rt.step_s)
    limit_needed = math.ceil(rt.total_s / 60 / (1 + rt.max_requeue))
    fewer = f", or train.steps={steps_that_fit} or fewer" if steps_that_fit else ""
    return [
        f"the run cannot finish in its allocations: {rt.steps:,} steps x {rt.step_s:.4g} s"
        f" (predicted) = {duration(rt.total_s)}, but machine.slurm.time_min={rt.limit_min} x"
        f" (1 + max_requeue={rt.max_requeue}) = {duration(rt.budget_s)}; set"
        f" max_requeue={rt.allocations - 1}, or machine.slurm.time_min={limit_needed} if the"
        f" site allows it{fewer}, or use more nodes (nodes=N)"
    ]


def preflight_on(cfg: LaunchConfig) -> bool:
    """``preflight`` as given; unset (null): on for Slurm machines, off on this computer."""
    return cfg.preflight if cfg.preflight is not None else cfg.machine.scheduler == "slurm"


def preflight_words(cfg: LaunchConfig) -> str:
    if not preflight_on(cfg):
        return "off" + ("" if cfg.preflight is False else " (preflight=true runs it)")
    ex = cfg.machine.preflight_expectations()
    floor = f" or {ex.gemm_min_tflops:.3g} TFLOP/s" if ex.gemm_min_tflops else ""
    bandwidth = (
        f"warn below {ex.intra_node_min_gbps:.3g}/{ex.inter_node_min_gbps:.3g} GB/s inside/across"
        " nodes"
        if ex.intra_node_min_gbps or ex.inter_node_min_gbps
        else "logged"
    )
    network = f"; network /{ex.network}/ across nodes" if ex.network else ""
    return (
        f"on: a rank below {ex.slow_fraction:g} x the median GEMM rate{floor} is slow"
        f" ({ex.on_slow}); all-reduce bandwidth {bandwidth}{network}"
    )


def planner_note(pick: int) -> str:
    """grid.pick=k takes the planner's (k+1)-th best grid."""
    return " (planner's best)" if pick == 0 else f" (planner's choice {pick + 1})"


def next_line(job_dir: Path, *, ran: bool) -> str:
    """The commands to copy after a run (``ran``) or a detached submission: the job's
    status, then its report (plots), with this interpreter and the real job dir."""
    python, where = (shlex.quote(command_path(p)) for p in (sys.executable, str(job_dir)))
    status = f"{python} -m axonn_launch.jobs status {where}"
    report = f"{python} -m axonn_launch.report {where}"
    return f"next: {status}; {report}" if ran else f"next: {status}  (once it ran: {report})"


def command_path(path: str) -> str:
    """``python`` when that is this interpreter on PATH (an activated venv); otherwise
    ``path`` relative to the current directory when it lies below it, else absolute."""
    if path == sys.executable and shutil.which("python") == sys.executable:
        return "python"
    relative = os.path.relpath(path)
    if relative.startswith(".."):
        return os.path.abspath(path)
    return relative if os.sep in relative or relative == "." else f".{os.sep}{relative}"
