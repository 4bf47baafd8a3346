"""What the training loop tells the watchdog, and the ranks' own work per step.

``StepMonitor`` is the loop's one handle on both: it moves the watchdog
(``train/health/watchdog.py``) through each step's sections with the step's deadline, lowers
the collectives' timeout once start-up is over, and every ``train.stragglers.every``
steps gathers each rank's own work per step and names the ranks that are slow in two
exchanges in a row (rank 0 logs them, writes ``stragglers.json`` and adds them to the
next metrics row and the summary).

A rank's own work in a step is the time from the step's start until it enters the
step-boundary all-reduce, less the time it spent blocked in any collective on the way
(every tensor-parallel, z and data collective and every wait on an asynchronous handle:
``Comm.waits``, ``train/parallel/comm.py``). A slow rank keeps its peers waiting inside
those collectives, so their spans grow with its own, but their own work does not: the
slow rank shows little blocked time and a long own work, its peers the reverse. On a GPU
both the step's span and the blocked spans are read from CUDA events (no synchronization
in the step; the events are read at the exchange), on a CPU from the wall clock.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from axonn_launch.common.ranks import node_name
from axonn_launch.common.spec import StragglerConfig
from axonn_launch.train.health.watchdog import (
    Watchdog,
    checkpoint_deadline,
    collective_timeout,
    eval_deadline,
    persistent,
    step_deadline,
    straggler_line,
    straggler_report,
    write_stragglers,
)
from axonn_launch.train.parallel.comm import WaitClock
from axonn_launch.train.parallel.groups import Groups

log = logging.getLogger(__name__)


class WorkClock:
    """Each step's own work and blocked seconds since the last ``take`` (see the module
    docstring); ``waits`` is the comm layer's clock of time blocked in collectives."""

    def __init__(self, device: torch.device, waits: WaitClock | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.waits = waits if waits is not None else WaitClock()
        self.pending: list = []  # (start, end, Waited): perf_counter floats or CUDA events
        self.start: object = None
        self.first = True  # the next take holds the attempt's first step

    def begin(self) -> None:
        self.waits.cut()  # what was blocked outside a step (evaluation, saves) is not its
        self.start = self.now()

    def end(self) -> None:
        self.pending.append((self.start, self.now(), self.waits.cut()))

    def now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take(self) -> list[tuple[float, float]]:
        """``(own work, blocked)`` seconds of each step since the last ``take``; the first
        step of the attempt is left out (allocations, lazy start-up, GEMM tuning)."""
        steps, self.pending = self.pending, []
        if self.first and len(steps) > 1:
            steps = steps[1:]
        self.first = False
        found = []
        for start, end, waited in steps:
            span = start.elapsed_time(end) / 1000 if self.cuda else end - start
            blocked = waited.seconds()
            found.append((max(span - blocked, 0.0), blocked))
        return found


class StepMonitor:
    def __init__(
        self,
        watchdog: Watchdog | None,
        stragglers: StragglerConfig,
        groups: Groups,
        device: torch.device,
        *,
        job_dir: str = "",
        checkpoint_bytes_per_node: float = 0.0,
        rank: int = 0,
        waits: WaitClock | None = None,
    ) -> None:
        self.watchdog, self.stragglers, self.groups = watchdog, stragglers, groups
        self.clock = WorkClock(device, waits)
        self.device = device
        self.job_dir, self.rank = job_dir, rank
        self.checkpoint_bytes = checkpoint_bytes_per_node
        self.step_deadline = watchdog.cfg.startup_s if watchdog else 0.0
        self.timeouts_lowered = False
        self.nodes: list[str] | None = None
        self.reports: list[dict] = []  # the exchanges that named someone
        self.suspects: set[int] = set()  # ranks over the bar at the last exchange

    # the watchdog's sections

    def begin_step(self, step: int, timed: list[float]) -> None:
        self.clock.begin()
        if self.watchdog is not None:
            self.step_deadline = step_deadline(self.watchdog.cfg, timed, len(timed))
            self.watchdog.enter("data", step, self.step_deadline)

    def mark(self, section: str) -> None:
        if self.watchdog is not None:
            self.watchdog.mark(section)

    @contextlib.contextmanager
    def section(self, name: str, step: int) -> Iterator[None]:
        """A checkpoint save or an evaluation, on its own clock and deadline."""
        if self.watchdog is None:
            yield
            return
        cfg = self.watchdog.cfg
        if name == "checkpoint":
            deadline = checkpoint_deadline(cfg, self.checkpoint_bytes)
        else:
            deadline = eval_deadline(cfg, self.step_deadline)
        self.watchdog.enter(name, step, deadline)
        yield

    def eval_batch_done(self) -> None:
        """Progress within an evaluation: the next batch gets a deadline of its own (the
        evaluation section's, ``eval_deadline``), so the deadline follows the number of
        batches instead of bounding the whole evaluation."""
        if self.watchdog is not None:
            section = self.watchdog.section
            self.watchdog.enter(section.name, section.step, section.deadline_s)

    def compute_done(self) -> None:
        self.clock.end()

    def after_step(self, step: int, timed: list[float], logger) -> None:
        dog = self.watchdog
        if dog is not None and not self.timeouts_lowered and len(timed) >= dog.cfg.startup_steps:
            self.lower_collective_timeouts(step_deadline(dog.cfg, timed, len(timed)))
        every = self.stragglers.every
        if every > 0 and step % every == 0:
            self.exchange(step, logger)

    def lower_collective_timeouts(self, deadline_s: float) -> None:
        """torchtitan's pattern: a long timeout for start-up, then one derived from the
        step deadline, on every group the step uses (not the checkpoint saves' own)."""
        self.timeouts_lowered = True
        seconds = collective_timeout(self.watchdog.cfg, deadline_s)
        setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if seconds is None or setter is None or not dist.is_initialized():
            return
        groups = {id(g): g for g in self.step_groups()}
        for group in groups.values():
            setter(timedelta(seconds=seconds), group)
        log.debug("collective timeout after start-up: %.0f s", seconds)

    def step_groups(self) -> list:
        g = self.groups
        found = [g.world, g.x, g.y, g.z, g.data, g.plane, g.z_gather]
        return [group for group in found if group is not None]

    # stragglers

    def exchange(self, step: int, logger) -> None:
        """Collective over the world: every rank's least own work of a step since the
        last exchange (noise, a step in which the operating system paused the rank, only
        ever adds time: a straggler is slow even in its best step) and its median blocked
        seconds; rank 0 names the stragglers."""
        steps = self.clock.take() or [(0.0, 0.0)]
        mine = [min(w for w, _ in steps), statistics.median(b for _, b in steps)]
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return
        if self.nodes is None:
            self.nodes = [""] * world
            dist.all_gather_object(self.nodes, node_name(), group=self.groups.world)
        gathered = [torch.zeros(2, device=self.device) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor(mine, device=self.device), self.groups.world)
        work, blocked = ([float(t[i]) for t in gathered] for i in (0, 1))
        report = straggler_report(work, self.nodes, self.stragglers, step, blocked=blocked)
        report, self.suspects = persistent(report, self.suspects)
        if report["stragglers"] and self.rank == 0:
            self.reports.append(report)
            log.warning(straggler_line(report))
            write_stragglers(self.job_dir, report)
            logger.add_stragglers(report)

    def summary(self) -> dict:
        return {"stragglers": self.reports[-1]} if self.reports else {}
