"""The planner's library: enumerate every grid of a world size, drop the invalid and the
ones that do not fit in memory, rank the rest by the predicted step time (``cost/perf.py``).

Validity and the micro-batch follow ``common/rules.py``, as the launcher and the job do.
Each grid gets its micro-batch and weight cache chosen here, first within ``HEADROOM``
(90 %) of GPU memory, and rows with headroom rank before rows without.

Why the largest micro-batch, how the cache is chosen and why the headroom:
``docs/cost-model.md`` ("cost/planner.py").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import Hardware, MachineProfile
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.rules import (
    batch_problem,
    divisors,
    placement_problem,
    shape_problem,
)
from axonn_launch.common.spec import TrainConfig
from axonn_launch.cost.memory import (
    GIB,
    MemoryEstimate,
    estimate_memory,
    fit_micro_batch,
    largest_cache_that_fits,
)
from axonn_launch.cost.perf import (
    Calibration,
    StepTime,
    bounds,
    profile_calibration,
    step_time,
)


class PlanError(ValueError):
    """No grid can run this configuration; the message says why."""


HEADROOM = 0.9  # the share of GPU memory a planned run should stay within (module docstring)


def memory_share(memory_bytes: float, hardware: Hardware) -> float:
    """The estimate over the GPU's memory; 0 when the profile sets no limit (a CPU)."""
    capacity = hardware.mem_per_gpu_gb
    return memory_bytes / (capacity * GIB) if capacity > 0 else 0.0


def has_headroom(memory_bytes: float, hardware: Hardware) -> bool:
    """Within ``HEADROOM`` of the GPU's memory (always, where there is no limit)."""
    return memory_share(memory_bytes, hardware) <= HEADROOM


@dataclass(frozen=True)
class PlanRow:
    rank: int
    grid: Grid
    micro_batch: int
    cache_layers: int  # blocks whose gathered weights are kept (given, or chosen)
    memory: MemoryEstimate  # of the micro-batch and cache chosen
    step: StepTime  # the predicted step of the micro-batch and cache chosen
    memory_share: float = 0.0  # of the GPU's memory (0: no limit); > HEADROOM: tight

    @property
    def accumulation(self) -> int:
        return self.step.accumulation

    @property
    def step_time_s(self) -> float:
        return self.step.total

    @property
    def compute_s(self) -> float:
        return self.step.compute

    @property
    def tflops_per_gpu(self) -> float:
        return self.step.tflops_per_gpu

    @property
    def fraction_of_peak(self) -> float:
        return self.step.fraction_of_peak

    @property
    def comm_s(self) -> dict[str, float]:
        """Exposed communication per axis (x, y, z, data, xy)."""
        return self.step.comm

    @property
    def memory_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def headroom(self) -> bool:
        return self.memory_share <= HEADROOM

    def as_dict(self) -> dict[str, Any]:
        """The row as ``plan output=json`` writes it: its figures, not the objects."""
        figures = {key: getattr(self, key) for key in AS_DICT_FIGURES}
        return {"rank": self.rank, "grid": self.grid.as_dict(), **figures}


AS_DICT_FIGURES = (
    "micro_batch", "cache_layers", "accumulation", "step_time_s", "compute_s",
    "tflops_per_gpu", "fraction_of_peak", "comm_s", "memory_share", "memory_gib",
)  # fmt: skip


# --------------------------------------------------------------------------- enumeration


def enumerate_grids(world_size: int) -> list[Grid]:
    """Every (data, x, y, z) with data*x*y*z == world_size, in a fixed order."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be a positive integer")
    grids = []
    for x in divisors(world_size):
        for y in divisors(world_size // x):
            for z in divisors(world_size // (x * y)):
                grids.append(Grid(data=world_size // (x * y * z), x=x, y=y, z=z))
    return grids


# --------------------------------------------------------------------------- ranking


@dataclass(frozen=True)
class Ranking:
    rows: list[PlanRow]  # every runnable grid: with headroom first, each group fastest first
    considered: int
    rejected: dict[str, int]  # reason kind -> count
    example: dict[str, str]  # reason kind -> one full message


def rank_grids(
    *,
    hardware: Hardware,
    model: ModelSpec,
    train: TrainConfig,
    world_size: int,
    calibration: Calibration | None = None,
) -> Ranking:
    """Evaluate every grid of ``world_size``; see the module docstring for the micro-batch
    and the order."""
    cal = calibration or profile_calibration(hardware)
    rows: list[PlanRow] = []
    rejected: dict[str, int] = {}
    example: dict[str, str] = {}
    grids = enumerate_grids(world_size)
    for grid in grids:
        result = evaluate_grid(hardware, model, train, grid, cal)
        if isinstance(result, PlanRow):
            rows.append(result)
        else:
            kind, why = result
            rejected[kind] = rejected.get(kind, 0) + 1
            example.setdefault(kind, why)
    rows.sort(key=lambda r: (not r.headroom, r.step_time_s, r.grid.x, r.grid.y, r.grid.z))
    rows = [dataclasses.replace(r, rank=i + 1) for i, r in enumerate(rows)]
    return Ranking(rows=rows, considered=len(grids), rejected=rejected, example=example)


def evaluate_grid(
    hardware: Hardware,
    model: ModelSpec,
    train: TrainConfig,
    grid: Grid,
    cal: Calibration,
) -> PlanRow | tuple[str, str]:
    """The grid's plan row (rank 0 = unranked), or (reason kind, message) if it cannot run."""
    why = placement_problem(hardware, grid)
    if why:
        return "placement", why
    why = shape_problem(model, grid)
    if why:
        return "shape", why
    why = batch_problem(train, grid)
    if why:
        return "batch", why
    chosen = fit_micro_batch(model, grid, train, within_headroom(hardware))
    if isinstance(chosen, str):
        chosen = fit_micro_batch(model, grid, train, hardware)
    if isinstance(chosen, str):
        return "memory", chosen
    micro, memory = chosen
    tr = dataclasses.replace(train, micro_batch=micro)
    tr, memory, st = _with_cache(hardware, model, tr, grid, cal, memory)
    return PlanRow(
        rank=0,
        grid=grid,
        micro_batch=micro,
        cache_layers=tr.cache_layers,
        memory=memory,
        step=st,
        memory_share=memory_share(memory.total, hardware),
    )


def within_headroom(hardware: Hardware) -> Hardware:
    """``hardware`` with ``HEADROOM`` of its GPU memory (unchanged where unbounded)."""
    if hardware.mem_per_gpu_gb <= 0:
        return hardware
    return dataclasses.replace(hardware, mem_per_gpu_gb=hardware.mem_per_gpu_gb * HEADROOM)


def resolve_cache_layers(
    hardware: Hardware,
    model: ModelSpec,
    train: TrainConfig,
    grid: Grid,
    calibration: Calibration | None = None,
) -> int:
    """``train.cache_layers`` as given, or (None) the planner's choice for this grid and
    ``train.micro_batch`` (module docstring); for launching an explicit grid."""
    memory = estimate_memory(model=model, grid=grid, train=train)
    cal = calibration or profile_calibration(hardware)
    chosen, _, _ = _with_cache(hardware, model, train, grid, cal, memory)
    return chosen.cache_layers


def _with_cache(
    hardware: Hardware,
    model: ModelSpec,
    train: TrainConfig,
    grid: Grid,
    cal: Calibration,
    memory: MemoryEstimate,
) -> tuple[TrainConfig, MemoryEstimate, StepTime]:
    """``train`` with its cache_layers (as given, or chosen: module docstring), the memory
    estimate and the predicted step of that choice."""

    def predict(tr: TrainConfig) -> StepTime:
        return step_time(hardware=hardware, model=model, train=tr, grid=grid, calibration=cal)

    if train.cache_layers is not None:
        return train, memory, predict(train)
    none = dataclasses.replace(train, cache_layers=0)
    base = predict(none)
    room = within_headroom(hardware) if has_headroom(memory.total, hardware) else hardware
    most = largest_cache_that_fits(model, grid, none, room.mem_per_gpu_gb, on_gpu=room.runs_on_gpu)
    if most == 0:
        return none, memory, base
    cached = dataclasses.replace(train, cache_layers=most)
    faster = predict(cached)
    if faster.total >= base.total:
        return none, memory, base
    gpu = hardware.runs_on_gpu
    return cached, estimate_memory(model=model, grid=grid, train=cached, on_gpu=gpu), faster


def predicted_range(
    hardware: Hardware,
    model: ModelSpec,
    train: TrainConfig,
    row: PlanRow,
    calibration: Calibration | None = None,
) -> tuple[StepTime, StepTime]:
    """(slowest, fastest) step of ``row``'s grid, micro-batch and cache with the inputs
    that are not measured on the machine at the ends of their ranges (``perf.bounds``)."""
    tr = dataclasses.replace(train, micro_batch=row.micro_batch, cache_layers=row.cache_layers)
    slow, fast = bounds(calibration or profile_calibration(hardware))
    return tuple(  # type: ignore[return-value]
        step_time(hardware=hardware, model=model, train=tr, grid=row.grid, calibration=c)
        for c in (slow, fast)
    )


def plan(
    *,
    machine: MachineProfile,
    model: ModelSpec,
    train: TrainConfig,
    nodes: int,
    top: int = 5,
    calibration: Calibration | None = None,
) -> list[PlanRow]:
    """The ``top`` first rows on ``nodes`` nodes of ``machine``: the grids with headroom
    fastest first, then the others (module docstring)."""
    ranking = rank_machine(machine, model, train, nodes, calibration)
    return ranking.rows[: max(0, top)]


def best_grid(
    *,
    machine: MachineProfile,
    model: ModelSpec,
    train: TrainConfig,
    nodes: int,
    calibration: Calibration | None = None,
) -> PlanRow:
    """The first row (for grid=auto): the fastest grid with headroom, else the fastest;
    use its ``micro_batch`` and ``cache_layers`` too.

    Raises PlanError naming why every grid was rejected.
    """
    ranking = rank_machine(machine, model, train, nodes, calibration)
    if not ranking.rows:
        raise PlanError(explain_empty(ranking, machine, model, nodes))
    return ranking.rows[0]


MAX_NODES = 16384  # the largest node count searched when none is given


def smallest_nodes(
    *,
    machine: MachineProfile,
    model: ModelSpec,
    train: TrainConfig,
    max_nodes: int = MAX_NODES,
    calibration: Calibration | None = None,
) -> int:
    """The smallest power-of-two node count (up to ``max_nodes``) with a runnable grid.

    For grid=auto without nodes. Raises PlanError with the reasons at ``max_nodes``.
    """
    nodes = 1
    while True:
        ranking = rank_machine(machine, model, train, nodes, calibration)
        if ranking.rows:
            return nodes
        if nodes * 2 > max_nodes:
            raise PlanError(explain_empty(ranking, machine, model, nodes))
        nodes *= 2


def more_nodes_with_headroom(
    *,
    machine: MachineProfile,
    model: ModelSpec,
    train: TrainConfig,
    nodes: int,
    calibration: Calibration | None = None,
) -> tuple[int, PlanRow] | None:
    """The first of nodes+1, nodes+2 and 2 x nodes where the first row has headroom, and
    that row: the "more nodes" fix for a run above ``HEADROOM``. Three rankings at most,
    not a search: enough to name a node count that works."""
    for more in sorted({nodes + 1, nodes + 2, 2 * nodes}):
        if more > MAX_NODES:
            break
        rows = rank_machine(machine, model, train, more, calibration).rows
        if rows and rows[0].headroom:
            return more, rows[0]
    return None


def rank_machine(machine, model, train, nodes, calibration) -> Ranking:
    if nodes < 1:
        raise PlanError(f"nodes={nodes}: must be a positive integer")
    world = nodes * machine.hardware.gpus_per_node
    return rank_grids(
        hardware=machine.hardware,
        model=model,
        train=train,
        world_size=world,
        calibration=calibration,
    )


REJECTED_BECAUSE = {
    "placement": "put x across nodes",
    "shape": "do not divide the model's shapes",
    "batch": "do not divide the batch",
    "memory": "do not fit in memory",
}


def explain_empty(ranking: Ranking, machine: MachineProfile, model: ModelSpec, nodes: int) -> str:
    parts = [
        f"{n} {REJECTED_BECAUSE.get(kind, kind)} (e.g. {ranking.example[kind]})"
        for kind, n in sorted(ranking.rejected.items(), key=lambda kv: -kv[1])
    ]
    return (
        f"no grid of {nodes} node(s) of {machine.name} can run {model.name}: all "
        f"{ranking.considered} grids rejected: " + "; ".join(parts)
    )


def why_nothing_fits(
    *,
    machine: MachineProfile,
    model: ModelSpec,
    train: TrainConfig,
    nodes: int,
    calibration: Calibration | None = None,
) -> str:
    """What ruled out every grid of ``nodes`` nodes, and the fewest nodes where one fits."""
    ranking = rank_machine(machine, model, train, nodes, calibration)
    text = explain_empty(ranking, machine, model, nodes)
    try:
        fewest = smallest_nodes(
            machine=machine,
            model=model,
            train=train,
            calibration=calibration,
        )
    except PlanError:
        return f"{text}; no node count up to {MAX_NODES} fits either"
    return f"{text}; the fewest nodes where a grid fits: nodes={fewest}"
