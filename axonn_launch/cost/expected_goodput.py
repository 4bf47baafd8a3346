"""Predicted goodput and the checkpoint interval (Young/Daly), on the login node.

Torch-free: ``plan`` and the launch summary print these figures, and
``train.checkpoint_every=auto`` becomes the interval in steps here, before the job exists.

Notation, all in seconds: δ the time to save one checkpoint, M the job's mean time between
failures, R the cost of a restart, τ the training time between two checkpoints.

* δ = bytes per checkpoint / the job's write bandwidth, unless a measured save time is given.
  A checkpoint holds each parameter's fp32 value and its two fp32 AdamW moments, each
  element written once (one replica of each shard writes, ``train/parallel/shards.py``): the memory
  model's ``parameters`` and ``optimizer`` bytes per element (``memory.BYTES_PER_PARAM_STATE``,
  4 + 8) times ``model.n_params()``. The bandwidth is the job's nodes times
  ``machine.reliability.write_gbps_per_node``, the filesystem's share per node (the
  filesystem, not a node's link, limits a checkpoint). Saves are asynchronous
  (``train/checkpoint/manager.py``: only the copy to host memory holds the step loop), so δ as the
  whole write is an upper bound of what a save costs the training.
* M = ``machine.reliability.node_mtbf_hours`` x 3600 / nodes: nodes fail independently and
  any failure ends the synchronous job.
* τ_opt, Daly's first-order optimum (J. T. Daly, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", Future Generation Computer Systems 22(3), 2006,
  pp. 303-312): τ_opt = sqrt(2 δ M) - δ for δ < 2M, else τ_opt = M. It refines Young's
  sqrt(2 δ M) (J. W. Young, "A first order approximation to the optimum checkpoint
  interval", CACM 17(9), 1974) by the save time itself; for δ << M the two agree.
* ``auto`` steps = max(1, round(τ_opt / the predicted step time)), the step time of
  ``cost/perf.step_time`` (uncalibrated, as ``plan`` ranks grids and the summary predicts).
* R = ``machine.reliability.restart_s`` (failure to training again: detection, requeue,
  start-up) + δ (reading the checkpoint back, taken to be as fast as writing it; the three
  site filesystems read at least as fast as they write).
* Expected goodput, the fraction of the allocated time that trains, to first order::

      goodput = τ / (τ + δ) x (1 - (R + (τ + δ) / 2) / M), clamped to [0, 1]

  The first factor is the share of a failure-free segment (train τ, save δ) that trains; the
  second takes away, at 1/M failures per second, each failure's restart R and the half
  segment recomputed on average since the last checkpoint. With ``train.checkpoint_every=0``
  (a checkpoint only at the end and on a requeue signal) τ is the whole run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from axonn_launch.common.machine import MachineProfile
from axonn_launch.common.models import ModelSpec
from axonn_launch.cost.memory import BYTES_PER_PARAM_STATE

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
    restart_s: float  # R (restart_s + δ)
    optimal_s: float  # τ_opt
    auto_steps: int  # τ_opt in steps
    every: int  # the interval the job runs: auto's, or as given; 0 = only at the end
    auto: bool  # train.checkpoint_every=auto

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
        restart_s=machine.reliability.restart_s + save,
        optimal_s=optimal,
        auto_steps=auto_steps,
        every=auto_steps if every is None else every,
        auto=every is None,
    )
