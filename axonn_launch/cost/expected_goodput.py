"""Predicted goodput and the checkpoint interval (Young/Daly), on the login node.

Torch-free: ``plan`` and the launch summary print these figures, and
``train.checkpoint_every=auto`` becomes the interval in steps here, before the job exists.
The inputs are the checkpoint's size, the file system's write bandwidth, the nodes' mean
time between failures and the restart: the profile's ``reliability.restart_s`` where set,
else detection plus the start-up model at the job's node count (``cost/startup.py``).

The formulas and their sources (Young 1974, Daly 2006): ``docs/cost-model.md``
("cost/expected_goodput.py").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from axonn_launch.common.machine import MachineProfile
from axonn_launch.common.models import ModelSpec
from axonn_launch.cost.memory import BYTES_PER_PARAM_STATE
from axonn_launch.cost.startup import Restart, restart

CHECKPOINT_TERMS = ("parameters", "optimizer")  # what a checkpoint holds (no gradients)
HOUR_S = 3600.0


def checkpoint_bytes(model: ModelSpec) -> float:
    """Bytes one checkpoint writes: fp32 parameters and both AdamW moments, once each."""
    per_element = sum(BYTES_PER_PARAM_STATE[term] for term in CHECKPOINT_TERMS)
    return per_element * model.n_params()


def job_write_gbps(machine: MachineProfile, nodes: int) -> float:
    """GB/s the filesystem takes from a job of ``nodes`` nodes."""
    return nodes * machine.reliability.write_gbps_per_node


def save_seconds(model: ModelSpec, machine: MachineProfile, nodes: int) -> float:
    """δ estimated: the checkpoint's bytes over the job's write bandwidth."""
    return checkpoint_bytes(model) / (job_write_gbps(machine, nodes) * 1e9)


def job_mtbf_seconds(machine: MachineProfile, nodes: int) -> float:
    """M: the node MTBF over the job's nodes; 0 when the profile knows no failure rate."""
    return machine.reliability.node_mtbf_hours * HOUR_S / nodes


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's first-order optimum compute time between checkpoints (module docstring)."""
    if save_s < 0 or mtbf_s <= 0:
        raise ValueError(f"save_s={save_s}, mtbf_s={mtbf_s}: need save_s >= 0 and mtbf_s > 0")
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    return math.sqrt(2 * save_s * mtbf_s) - save_s


def expected_goodput(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """The fraction of allocated time that trains, first order (module docstring)."""
    segment = interval_s + save_s
    if segment <= 0 or mtbf_s <= 0:
        raise ValueError(f"interval_s={interval_s}, save_s={save_s}, mtbf_s={mtbf_s}: need a"
                         " positive segment and mtbf_s > 0")  # fmt: skip
    useful = interval_s / segment
    lost = (restart_s + segment / 2) / mtbf_s
    return min(1.0, max(0.0, useful * (1 - lost)))


def interval_steps(interval_s: float, step_s: float) -> int:
    """The interval in whole steps: round(τ / step time), at least 1."""
    if step_s <= 0:
        raise ValueError(f"step_s={step_s}: a predicted step time must be > 0")
    return max(1, round(interval_s / step_s))


@dataclass(frozen=True)
class Checkpointing:
    """One job's checkpoint interval and expected goodput (module docstring)."""

    step_s: float  # predicted seconds per step
    steps: int  # the run's steps (train.steps)
    save_s: float  # δ
    save_measured: bool  # δ measured (else bytes / bandwidth)
    checkpoint_gb: float  # bytes per checkpoint / 1e9
    write_gbps: float  # the job's write bandwidth
    node_mtbf_hours: float
    nodes: int
    mtbf_s: float  # M
    restart_s: float  # R (the restart + δ)
    optimal_s: float  # τ_opt
    auto_steps: int  # τ_opt in steps
    every: int  # the interval the job runs: auto's, or as given; 0 = only at the end
    auto: bool  # train.checkpoint_every=auto
    restart: Restart | None = None  # R - δ and where it comes from (cost/startup.py)

    @property
    def interval_s(self) -> float:
        """τ of the interval the job runs; the whole run for ``every == 0``."""
        return (self.every or self.steps) * self.step_s

    @property
    def goodput(self) -> float:
        return expected_goodput(self.interval_s, self.save_s, self.restart_s, self.mtbf_s)

    @property
    def auto_goodput(self) -> float:
        interval = self.auto_steps * self.step_s
        return expected_goodput(interval, self.save_s, self.restart_s, self.mtbf_s)

    def as_dict(self) -> dict:
        return {
            "checkpoint_every": self.every,
            "auto": self.auto,
            "expected_goodput": self.goodput,
            "auto_checkpoint_every": self.auto_steps,
            "auto_expected_goodput": self.auto_goodput,
            "optimal_interval_s": self.optimal_s,
            "step_time_s": self.step_s,
            "save_s": self.save_s,
            "save_measured": self.save_measured,
            "checkpoint_gb": self.checkpoint_gb,
            "write_gbps": self.write_gbps,
            "node_mtbf_hours": self.node_mtbf_hours,
            "job_mtbf_s": self.mtbf_s,
            "restart_s": self.restart_s,
            "restart": None if self.restart is None else self.restart.as_dict(),
            "formula": "Daly 2006 first order: sqrt(2*save_s*job_mtbf_s) - save_s",
        }


def predict(
    *,
    machine: MachineProfile,
    model: ModelSpec,
    nodes: int,
    step_s: float,
    steps: int,
    every: int | None,
    measured_save_s: float | None = None,
) -> Checkpointing | None:
    """The interval and goodput of a job; ``every`` None = auto (Daly's interval). None when
    the profile knows no failure rate (``machine.reliability.node_mtbf_hours`` 0).

    ``measured_save_s``: a save time measured in an earlier run of the job, used as δ."""
    mtbf = job_mtbf_seconds(machine, nodes)
    if mtbf <= 0:
        return None
    save = save_seconds(model, machine, nodes) if measured_save_s is None else measured_save_s
    again = restart(machine, nodes)
    optimal = daly_interval(save, mtbf)
    auto_steps = interval_steps(optimal, step_s)
    return Checkpointing(
        step_s=step_s,
        steps=steps,
        save_s=save,
        save_measured=measured_save_s is not None,
        checkpoint_gb=checkpoint_bytes(model) / 1e9,
        write_gbps=job_write_gbps(machine, nodes),
        node_mtbf_hours=machine.reliability.node_mtbf_hours,
        nodes=nodes,
        mtbf_s=mtbf,
        restart_s=again.seconds + save,
        optimal_s=optimal,
        auto_steps=auto_steps,
        every=auto_steps if every is None else every,
        auto=every is None,
        restart=again,
    )


# A new job's wait in the queue after a failure that ends the job: a default stated as one,
# not a measurement (a new 1,024-node allocation can wait hours); plan's queue_wait_h=
# changes it.
DEFAULT_QUEUE_WAIT_S = HOUR_S


@dataclass(frozen=True)
class SpareCost:
    """What ``spares`` idle nodes cost a run and the goodput they buy (``spare_cost``)."""

    spares: int
    nodes: int  # the grid's
    failures: float  # node failures expected while the run trains
    in_place: float  # the share of them a spare takes, restarted in the same job
    queue_wait_s: float  # a new job's wait after a failure that ends the job
    wall_s_with: float  # first start to the end, queue waits included
    wall_s_without: float
    goodput_with: float  # training time over that wall time
    goodput_without: float

    @property
    def node_hours(self) -> float:
        """The spares' node-hours: idle beside the grid for the whole run."""
        return self.spares * self.wall_s_with / HOUR_S

    def as_dict(self) -> dict:
        return {"spare_nodes": self.spares, "spare_node_hours": self.node_hours,
                "node_failures_expected": self.failures, "restarted_on_a_spare": self.in_place,
                "queue_wait_s": self.queue_wait_s, "wall_s_with": self.wall_s_with,
                "wall_s_without": self.wall_s_without, "goodput_with": self.goodput_with,
                "goodput_without": self.goodput_without}  # fmt: skip


def spare_cost(ck: Checkpointing, spares: int, restarts: int, queue_wait_s: float) -> SpareCost:
    """The goodput of ``ck``'s job with ``spares`` nodes and without, over the run's wall
    time with the queue waits (``expected_goodput`` with R + the wait for a failure that
    ends the job). A failure restarts in place on a spare while one is left and a restart
    in place is (``restarts``): of the run's expected failures, that many at most; without
    spares every node failure ends the job and the next one waits in the queue."""
    if spares < 0 or restarts < 0 or queue_wait_s < 0:
        raise ValueError(f"spares={spares}, restarts={restarts}, queue_wait_s={queue_wait_s}:"
                         " each must be >= 0")  # fmt: skip
    train_s = ck.steps * ck.step_s
    failures = train_s / ck.mtbf_s
    covered = min(spares, restarts)
    in_place = 1.0 if failures <= covered else covered / failures
    restart_with = ck.restart_s + (1 - in_place) * queue_wait_s
    with_spares = expected_goodput(ck.interval_s, ck.save_s, restart_with, ck.mtbf_s)
    without = expected_goodput(ck.interval_s, ck.save_s, ck.restart_s + queue_wait_s, ck.mtbf_s)
    return SpareCost(spares=spares, nodes=ck.nodes, failures=failures, in_place=in_place,
                     queue_wait_s=queue_wait_s, wall_s_with=_wall(train_s, with_spares),
                     wall_s_without=_wall(train_s, without), goodput_with=with_spares,
                     goodput_without=without)  # fmt: skip


def _wall(train_s: float, goodput: float) -> float:
    """The wall time that trains ``train_s`` at ``goodput`` (inf when nothing trains)."""
    return train_s / goodput if goodput > 0 else math.inf
