"""The launch summary: what will run, where, for how long, and why these nodes.

Printed on every launch and dry run and written to the job dir's ``axonn_launch.log``:
the checkpoint interval and expected goodput where the machine knows a failure rate, and
on Slurm the account and the wall-clock, with warnings for a run that cannot finish or
is planned above ``planner.HEADROOM`` of GPU memory. Never imports torch.

What each line says, and predictions on a rehearsal: ``docs/launch.md``
("submit/summary.py").
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from axonn_launch import scheduler
from axonn_launch.common.durations import duration
from axonn_launch.common.machine import SlurmSettings
from axonn_launch.common.rules import micro_batch_candidates
from axonn_launch.common.spec import TrainConfig
from axonn_launch.config.compose import LaunchConfig, account_override
from axonn_launch.config.resolve import Resolved, placeholder
from axonn_launch.cost import planner
from axonn_launch.cost.expected_goodput import Checkpointing, job_mtbf_seconds
from axonn_launch.cost.memory import GIB, estimate_memory, largest_cache_that_fits
from axonn_launch.submit import chain, in_job
from axonn_launch.submit.generation_summary import (
    generation_lines,
    generation_next_line,
    generation_out,
)


def summary(cfg: LaunchConfig, resolved: Resolved, job_dir: Path) -> str:
    """The lines the console and ``axonn_launch.log`` get before anything runs."""
    if cfg.generate.prompts:  # a generation job: what it generates, not how it would train
        return generation_summary(cfg, resolved, job_dir)
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
    lines += goldfish_lines(train)
    if scheduler.of(cfg.machine).queued:
        lines += slurm_lines(cfg, run_time(cfg, resolved))
        lines += restart_lines(cfg, resolved, run_time(cfg, resolved))
    if resolved.checkpointing is not None:
        lines += checkpoint_lines(resolved.checkpointing, cfg)
    lines += [f"preflight  {preflight_words(cfg)}", f"job dir    {job_dir}"]
    return "\n".join(lines)


def goldfish_lines(train: TrainConfig) -> list[str]:
    """The Goldfish loss, when on (``train.goldfish.k`` > 0): which labels leave the loss."""
    fish = train.goldfish
    if fish.k <= 0:
        return []
    context = "" if fish.strategy == "static" else f", context h={fish.h}"
    return [
        f"loss       Goldfish: about 1 label in {fish.k} left out of the loss"
        f" ({fish.strategy}{context}; train.goldfish.k=0: the standard loss)"
    ]


def nodes_reason(cfg: LaunchConfig, resolved: Resolved) -> str:
    """Where the node count came from: this computer, nodes=, the planner's search
    (``plan.smallest_nodes``, as ``plan`` without nodes=) or the grid's size."""
    if scheduler.of(cfg.machine).on_this_computer:
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
    limit_source: str = "machine.slurm.time_min"  # where limit_min comes from, in words

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
        limit_min=cfg.machine.slurm.limit_min(resolved.nodes),
        max_requeue=cfg.max_requeue,
        limit_source=time_limit_source(cfg.machine.slurm, resolved.nodes),
    )


def time_limit_source(slurm: SlurmSettings, nodes: int) -> str:
    """Where the time limit comes from: the key, or with ``auto`` the site's bin."""
    if slurm.time_min is not None:
        return "machine.slurm.time_min"
    up_to = next((n for n, _ in slurm.time_bins if nodes <= n), slurm.time_bins[-1][0])
    return f"machine.slurm.time_min=auto: the site's longest for up to {up_to} nodes"


def slurm_lines(cfg: LaunchConfig, rt: RunTime) -> list[str]:
    return [
        f"account    {account_words(cfg)}",
        f"time limit {rt.limit_min} min ({rt.limit_source}) x"
        f" {plural(1 + rt.max_requeue, 'allocation')} (1 + max_requeue={rt.max_requeue})"
        f" = {duration(rt.budget_s)}",
        f"predicted  {prediction_words(cfg, rt)}",
    ]


def restart_lines(cfg: LaunchConfig, resolved: Resolved, rt: RunTime) -> list[str]:
    """How a failed step is restarted inside the job, and what its spare nodes cost in
    node-hours against the node failures the profile's MTBF expects in the run."""
    if not in_job.enabled(cfg):
        return []
    limit = cfg.recovery.in_job_restarts
    words = f"in place, up to {plural(limit, 'time')} per job (recovery.in_job_restarts), then"
    words += " a new job (the chain)" if chain.enabled(cfg) else " the job ends"
    spares = in_job.spares(cfg)
    if not spares:
        return [f"restarts   {words}; no spare node (recovery.spare_nodes=0): a lost node ends"
                " the job"]  # fmt: skip
    return [f"restarts   {words}", f"spares     {spare_words(cfg, resolved.nodes, spares, rt)}"]


def spare_words(cfg: LaunchConfig, nodes: int, spares: int, rt: RunTime) -> str:
    """``1 node idle beside the grid's 2 (+50 % node-hours: ...); expected node failures``."""
    cost = f"{plural(spares, 'node')} idle beside the grid's {nodes} (+{spares / nodes:.0%}"
    mtbf = job_mtbf_seconds(cfg.machine, nodes)
    if not_predicted(cfg) or mtbf <= 0:
        return f"{cost} node-hours); each takes a failed node's place in the same job"
    hours = rt.total_s / 3600
    failures = rt.total_s / mtbf
    return (
        f"{cost} node-hours: {spares * hours:,.4g} node-h over the predicted"
        f" {duration(rt.total_s)});"
        f" {failures:.2g} node failures expected in the run (job MTBF {duration(mtbf)}, from"
        f" machine.reliability.node_mtbf_hours={cfg.machine.reliability.node_mtbf_hours:g}),"
        " each restarted on a spare instead of waiting in the queue for a new job"
    )


def hardware_words(cfg: LaunchConfig) -> str:
    """The hardware a prediction assumes: ``perlmutter's A100-SXM4-40GB``."""
    return f"{cfg.machine.name}'s {cfg.machine.hardware.gpu_model}"


def not_predicted(cfg: LaunchConfig) -> str:
    """Why no prediction applies to this run ("" when the site's does): a rehearsal runs
    on local CPUs, and CPU ranks are not what the profile's nominal figures describe."""
    if cfg.rehearse:
        return "this rehearsal runs on local CPUs: no prediction"
    if cfg.machine.hardware.gpu_model == "cpu":
        return (
            f"CPU ranks: machine={cfg.machine.name}'s figures are placeholders, not"
            " measurements of this computer"
        )
    return ""


def prediction_words(cfg: LaunchConfig, rt: RunTime) -> str:
    """The planner's step time x steps with the hardware it assumes; for a rehearsal the
    site's, marked as such; for CPU ranks none."""
    caveat = not_predicted(cfg)
    predicted = f"{rt.step_s:.4g} s/step on {hardware_words(cfg)} (planner, uncalibrated)"
    if cfg.rehearse:
        return f"site only: {predicted}; {caveat}"
    if caveat:
        return f"none ({caveat}); the run measures its s/step (jobs status)"
    takes = plural(rt.allocations, "allocation")
    if rt.allocations > 1:
        takes += f", {plural(rt.allocations - 1, 'requeue')}"
    return f"{predicted} x {rt.steps:,} steps = {duration(rt.total_s)}: {takes}"


def predicted_step_s(cfg: LaunchConfig, resolved: Resolved) -> float | None:
    """The planner's seconds per step for this run's hardware, for the record (the sweep
    table reads it); None where no prediction applies (``not_predicted``) or none exists."""
    if resolved.step_time is None or not_predicted(cfg):
        return None
    return resolved.step_time.total


def checkpoint_lines(ck: Checkpointing, cfg: LaunchConfig) -> list[str]:
    """The checkpoint interval the job runs and its expected goodput (``cost/expected_goodput.py``)
    on the machine whose failure rate it assumes (``goodput_words``)."""
    daly = f"Daly's {duration(ck.optimal_s)} over {ck.step_s:.3g} s/step"
    given = f"train.checkpoint_every={ck.every}"
    if ck.auto:
        interval = f"every {plural(ck.every, 'step')} (auto: {daly})"
    elif ck.every:
        interval = f"every {plural(ck.every, 'step')} ({given}); auto: {ck.auto_steps:,} ({daly})"
    else:
        interval = f"only at the end and on a requeue signal ({given}); auto: {ck.auto_steps:,}"
    written = f"{size_words(ck.checkpoint_gb * 1e9)} at {ck.write_gbps:,.4g} GB/s"
    return [
        f"checkpoint {interval}; a save {duration(ck.save_s)}"
        f" ({'measured' if ck.save_measured else written})",
        f"goodput    {goodput_words(ck, cfg)}",
    ]


def goodput_words(ck: Checkpointing, cfg: LaunchConfig) -> str:
    """The expected goodput on the machine whose failure rate it assumes; a rehearsal's is
    the site's, marked as such; CPU ranks get none (their profiles' rates are test values)."""
    auto = "" if ck.auto else f" ({ck.auto_goodput:.1%} with train.checkpoint_every=auto)"
    expected = (
        f"{ck.goodput:.1%} expected on {cfg.machine.name}{auto}: job MTBF {duration(ck.mtbf_s)}"
        f" ({ck.node_mtbf_hours:,.4g} h per node / {plural(ck.nodes, 'node')}), restart"
        f" {duration(ck.restart_s)}{restart_words(ck)}"
    )
    if cfg.rehearse:
        return f"site only: {expected}; this rehearsal runs on local CPUs: measured (jobs status)"
    if cfg.machine.hardware.gpu_model == "cpu":
        return (
            f"not predicted for CPU ranks (machine={cfg.machine.name}'s failure figures are"
            " test values); measured once the run ends (jobs status)"
        )
    return expected


def restart_words(ck: Checkpointing) -> str:
    """`` (detection 10 min + start-up ... at N nodes, extrapolated from ..., + the read-back
    58 s)``: where the restart's time comes from (``cost/startup.py``)."""
    if ck.restart is None:
        return ""
    return f" ({ck.restart.words()}, + the read-back {duration(ck.save_s)})"


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
        return (
            f"{placeholder('slurm.account')} ({account_override(cfg.site, cfg.machine.name)}=...)"
        )
    return "none (the cluster's default)"


def wallclock_warnings(cfg: LaunchConfig, resolved: Resolved) -> list[str]:
    """One warning when a Slurm run cannot finish in ``time_min x (1 + max_requeue)``,
    with what would make it fit; the launch still proceeds."""
    if not scheduler.of(cfg.machine).queued or not_predicted(cfg):
        return []
    if cfg.generate.prompts:  # a generation job: no steps to predict
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


def headroom_warnings(cfg: LaunchConfig, resolved: Resolved) -> list[str]:
    """One warning when the estimate per GPU is above ``planner.HEADROOM`` of the GPU's
    memory: the estimate leaves out the allocator's fragmentation and communication
    buffers, so such a run may not start. It names the fixes, each with the memory it
    gives; the launch still proceeds. Not for a generation job: it keeps no gradients or
    optimizer state, which the estimate counts."""
    hardware = cfg.machine.hardware
    share = planner.memory_share(resolved.memory.total, hardware)
    if share <= planner.HEADROOM or cfg.generate.prompts:
        return []
    fixes = headroom_fixes(cfg, resolved)
    used = resolved.memory.total / GIB
    return [
        f"memory: {used:.1f} of {hardware.mem_per_gpu_gb:g} GiB per GPU ({share:.0%}) is above"
        f" {planner.HEADROOM:.0%}, and the estimate leaves out the allocator's fragmentation and"
        " communication buffers: the run may not start"
        + (f"; for headroom: {', or '.join(fixes)}" if fixes else "")
    ]


def headroom_fixes(cfg: LaunchConfig, resolved: Resolved) -> list[str]:
    """What brings the memory per GPU down, as overrides: more nodes (the planner's grid
    there), activation checkpointing, a smaller micro-batch, fewer cached blocks."""
    fixes = [more_nodes_fix(cfg, resolved)]
    train, grid, model = resolved.train, resolved.grid, cfg.model

    def gives(**changes) -> str:
        tr = dataclasses.replace(train, **changes)
        memory = estimate_memory(model=model, grid=grid, train=tr, on_gpu=True).total
        share = planner.memory_share(memory, cfg.machine.hardware)
        return f"{memory / GIB:.1f} GiB, {share:.0%}"

    if not train.activation_checkpointing:
        fixes.append(
            "train.activation_checkpointing=true (activation checkpointing:"
            f" {gives(activation_checkpointing=True)})"
        )
    smaller = [m for m in micro_batch_candidates(train, grid) if m < train.micro_batch]
    if smaller:
        fixes.append(f"train.micro_batch={smaller[0]} (a smaller micro-batch:"
                     f" {gives(micro_batch=smaller[0])})")  # fmt: skip
    if train.cache_layers:
        room = planner.HEADROOM * cfg.machine.hardware.mem_per_gpu_gb
        fewer = largest_cache_that_fits(model, grid, train, room)
        fixes.append(f"train.cache_layers={fewer} (fewer cached blocks:"
                     f" {gives(cache_layers=fewer)})")  # fmt: skip
    return [fix for fix in fixes if fix]


def more_nodes_fix(cfg: LaunchConfig, resolved: Resolved) -> str:
    """``nodes=9 (one more node; the planner's data=1 x=4 y=4 z=2 there: 33.0 GiB, 83%)``,
    or "" on this computer or when a few more nodes give no grid with headroom."""
    if scheduler.of(cfg.machine).on_this_computer:
        return ""
    found = planner.more_nodes_with_headroom(
        machine=cfg.machine, model=cfg.model, train=cfg.train, nodes=resolved.nodes
    )
    if found is None:
        return ""
    nodes, row = found
    more = {1: "one more node", 2: "two more nodes"}.get(nodes - resolved.nodes, "twice the nodes")
    override = f"nodes={nodes}" if resolved.planned else f"grid=auto nodes={nodes}"
    return (
        f"{override} ({more}; the planner's {row.grid.describe()} there:"
        f" {row.memory_gib:.1f} GiB, {row.memory_share:.0%})"
    )


def preflight_on(cfg: LaunchConfig) -> bool:
    """``preflight`` as given; unset (null): on for Slurm machines, off on this computer."""
    return cfg.preflight if cfg.preflight is not None else scheduler.of(cfg.machine).queued


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


def dry_run_text(cfg: LaunchConfig, config_yaml: str, script: str, local_command: str) -> str:
    """What a dry run prints after the summary: the batch script (or the local command);
    a sweep's point only names it (the sweep's table follows). The resolved config, about
    280 lines of which the machine's ``sources:`` map is 90, only with ``show_config=true``;
    it is always the job dir's config.yaml."""
    if cfg.show_config:
        shown = ["--- resolved config (with machine.sources) ---", config_yaml.rstrip("\n")]
    else:
        shown = ["config     the job dir's config.yaml (show_config=true prints it, with the"
                 " machine's sources)"]  # fmt: skip
    if script and in_sweep() and not cfg.show_config:
        return "\n".join([*shown, "script     in the job dir (a point run alone prints it)"])
    shown += ["--- batch script ---" if script else "--- local command ---"]
    return "\n".join([*shown, (script or local_command).rstrip("\n")])


def in_sweep() -> bool:
    """Whether this launch is a point of a sweep (``-m``): Hydra's run mode."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def planner_note(pick: int) -> str:
    """grid.pick=k takes the planner's (k+1)-th best grid."""
    return " (planner's best)" if pick == 0 else f" (planner's choice {pick + 1})"


def next_line(job_dir: Path, *, ran: bool) -> str:
    """The commands to copy after a run (``ran``) or a detached submission: the job's
    status, then its report (plots), with this interpreter and the real job dir."""
    python, where = (shlex.quote(command_path(p)) for p in (sys.executable, str(job_dir)))
    status = f"{python} -m axonn_launch.jobs status {where}"
    out = generation_out(job_dir)
    if out:  # a generation job takes no step: nothing to report, its output to read
        return generation_next_line(status, command_path(out), ran=ran)
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


def generation_summary(cfg: LaunchConfig, resolved: Resolved, job_dir: Path) -> str:
    """A generation job's summary: its grid and place, then what it generates
    (``generation_summary.generation_lines``) instead of batch, steps and checkpoints."""
    grid, params = resolved.grid, cfg.model.n_params()
    lines = [
        f"job        {cfg.name}",
        f"machine    {cfg.machine.name} ({cfg.machine.hardware.gpu_model})",
        f"model      {cfg.model.name}: {params:,} parameters",
        f"grid       {grid.describe()} = {grid.world_size} ranks (data x z planes split the"
        " prompts)",
        *generation_lines(cfg),
        f"nodes      {resolved.nodes} x {resolved.tasks_per_node} tasks:"
        f" {nodes_reason(cfg, resolved)}",
        f"memory     {memory_words(cfg, resolved)}",
    ]
    if scheduler.of(cfg.machine).queued:
        lines += [
            f"account    {account_words(cfg)}",
            f"time limit {cfg.machine.slurm.limit_min(resolved.nodes)} min"
            f" ({time_limit_source(cfg.machine.slurm, resolved.nodes)})",
        ]
    lines += [f"preflight  {preflight_words(cfg)}", f"job dir    {job_dir}"]
    return "\n".join(lines)
