"""Choose the 4D grid: enumerate every grid of a world size, drop the invalid and the
ones that do not fit in memory, rank the rest by the predicted step time (perf.py).

CLI (login node, no torch):
    python -m axonn_launch.plan machine=frontier model=gpt_320b nodes=1024 top=5 \
        [train.global_batch=2048] [train.micro_batch=8] [calibration=cal.json] [output=json]
Everything but ``top``, ``output`` and ``calibration`` is a Hydra override, composed as the
launcher composes it (``config.load``): ``machine.hardware.*``, ``model.*`` and
``train.*`` can be changed too. ``calibration=`` is a file from ``axonn_launch.calibrate``.

Micro-batch: unless it is pinned (``fixed_micro_batch``, or ``train.micro_batch=`` on the
command line), each grid gets the largest micro-batch that is a multiple of z, divides the
per-replica batch (global_batch / data) and fits in memory. The largest one gives the
fewest micro-steps, hence the fewest weight all-gathers and reduce-scatters over z (which
repeat per micro-step), the fewest latency-bound collectives and the biggest GEMMs; the
activation all-reduces and the FLOPs per step do not depend on it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Any

from axonn_launch.grid import Grid
from axonn_launch.machine import Hardware, MachineProfile
from axonn_launch.memory import GIB, estimate_memory
from axonn_launch.models import ModelSpec
from axonn_launch.perf import COMM_AXES, Calibration, load_calibration, step_time
from axonn_launch.spec import TrainConfig


class PlanError(ValueError):
    """No grid can run this configuration; the message says why."""


@dataclass(frozen=True)
class PlanRow:
    rank: int
    grid: Grid
    micro_batch: int
    accumulation: int
    step_time_s: float
    compute_s: float
    tflops_per_gpu: float
    fraction_of_peak: float
    memory_gib: float
    comm_s: dict[str, float]  # exposed communication per axis (x, y, z, data, xy)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["grid"] = self.grid.as_dict()
        return out


# --------------------------------------------------------------------------- enumeration


def divisors(n: int) -> list[int]:
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


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


def shape_problem(model: ModelSpec, grid: Grid) -> str | None:
    """Why the model's shapes cannot be split over this grid, or None.

    Heads are split over y; every weight is split over x (one feature dim) and y (the
    other): h and f must divide by x*y. Each Linear's x*y block and the token table's
    plane block (vocab padded to a multiple of x*y) are then split over z.
    """
    xy = grid.x * grid.y
    if model.n_head % grid.y:
        return f"n_head={model.n_head} not divisible by y={grid.y}"
    if model.d_model % xy:
        return f"d_model={model.d_model} not divisible by x*y={xy}"
    if model.d_ff % xy:
        return f"d_ff={model.d_ff} not divisible by x*y={xy}"
    h, f = model.d_model, model.d_ff
    blocks = {
        "QKV weight block": 3 * h * h // xy,
        "projection weight block": h * h // xy,
        "MLP weight block": h * f // xy,
        "token table block": -(-model.vocab_size // xy) * h,
    }
    for name, elements in blocks.items():
        if elements % grid.z:
            return f"{name} of {elements} elements not divisible by z={grid.z}"
    return None


def batch_problem(train: TrainConfig, grid: Grid, micro_batch: int) -> str | None:
    if micro_batch < 1 or micro_batch % grid.z:
        return f"micro_batch={micro_batch} not divisible by z={grid.z}"
    if train.global_batch % (micro_batch * grid.data):
        return (
            f"global_batch={train.global_batch} not divisible by "
            f"micro_batch*data={micro_batch * grid.data}"
        )
    return None


def micro_batch_candidates(train: TrainConfig, grid: Grid) -> list[int]:
    """Valid micro-batches for this grid, largest first."""
    if train.global_batch % grid.data:
        return []
    per_replica = train.global_batch // grid.data
    return [m for m in reversed(divisors(per_replica)) if m % grid.z == 0]


# --------------------------------------------------------------------------- ranking


@dataclass(frozen=True)
class Ranking:
    rows: list[PlanRow]  # every runnable grid, fastest first
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
    fixed_micro_batch: bool = False,
) -> Ranking:
    """Evaluate every grid of ``world_size``; see the module docstring for the micro-batch."""
    cal = calibration or Calibration()
    rows: list[PlanRow] = []
    rejected: dict[str, int] = {}
    example: dict[str, str] = {}
    grids = enumerate_grids(world_size)
    for grid in grids:
        result = evaluate_grid(hardware, model, train, grid, cal, fixed_micro_batch)
        if isinstance(result, PlanRow):
            rows.append(result)
        else:
            kind, why = result
            rejected[kind] = rejected.get(kind, 0) + 1
            example.setdefault(kind, why)
    rows.sort(key=lambda r: (r.step_time_s, r.grid.x, r.grid.y, r.grid.z))
    rows = [dataclasses.replace(r, rank=i + 1) for i, r in enumerate(rows)]
    return Ranking(rows=rows, considered=len(grids), rejected=rejected, example=example)


def evaluate_grid(
    hardware: Hardware,
    model: ModelSpec,
    train: TrainConfig,
    grid: Grid,
    cal: Calibration,
    fixed_micro_batch: bool = False,
) -> PlanRow | tuple[str, str]:
    """The grid's plan row (rank 0 = unranked), or (reason kind, message) if it cannot run."""
    why = shape_problem(model, grid)
    if why:
        return "shape", why
    if fixed_micro_batch:
        why = batch_problem(train, grid, train.micro_batch)
        candidates = [] if why else [train.micro_batch]
    else:
        candidates = micro_batch_candidates(train, grid)
        why = f"global_batch={train.global_batch} not divisible by data*z={grid.data * grid.z}"
    if not candidates:
        return "batch", why
    chosen = _largest_fitting(model, grid, train, candidates, hardware.mem_per_gpu_gb)
    if chosen is None:
        tr = dataclasses.replace(train, micro_batch=candidates[-1])
        mem = estimate_memory(model=model, grid=grid, train=tr)
        return "memory", f"{grid.describe()} needs {mem.describe()}"
    micro, mem_bytes = chosen
    tr = dataclasses.replace(train, micro_batch=micro)
    st = step_time(hardware=hardware, model=model, train=tr, grid=grid, calibration=cal)
    return PlanRow(
        rank=0,
        grid=grid,
        micro_batch=micro,
        accumulation=st.accumulation,
        step_time_s=st.total,
        compute_s=st.compute,
        tflops_per_gpu=st.tflops_per_gpu,
        fraction_of_peak=st.fraction_of_peak,
        memory_gib=mem_bytes / GIB,
        comm_s=st.comm,
    )


def _largest_fitting(
    model: ModelSpec, grid: Grid, train: TrainConfig, candidates: list[int], mem_gb: float
) -> tuple[int, float] | None:
    """First candidate (they come largest first) whose memory estimate fits."""
    for micro in candidates:
        mem = estimate_memory(
            model=model, grid=grid, train=dataclasses.replace(train, micro_batch=micro)
        )
        if mem.fits(mem_gb):
            return micro, mem.total
    return None


def plan(
    *,
    machine: MachineProfile,
    model: ModelSpec,
    train: TrainConfig,
    nodes: int,
    top: int = 5,
    calibration: Calibration | None = None,
    fixed_micro_batch: bool = False,
) -> list[PlanRow]:
    """The ``top`` fastest runnable grids on ``nodes`` nodes of ``machine``."""
    ranking = _ranking(machine, model, train, nodes, calibration, fixed_micro_batch)
    return ranking.rows[: max(0, top)]


def best_grid(
    *,
    machine: MachineProfile,
    model: ModelSpec,
    train: TrainConfig,
    nodes: int,
    calibration: Calibration | None = None,
    fixed_micro_batch: bool = False,
) -> PlanRow:
    """The fastest runnable grid (for grid=auto); use its ``micro_batch`` too.

    Raises PlanError naming why every grid was rejected.
    """
    ranking = _ranking(machine, model, train, nodes, calibration, fixed_micro_batch)
    if not ranking.rows:
        raise PlanError(explain_empty(ranking, machine, model, nodes))
    return ranking.rows[0]


def smallest_nodes(
    *,
    machine: MachineProfile,
    model: ModelSpec,
    train: TrainConfig,
    max_nodes: int = 16384,
    calibration: Calibration | None = None,
    fixed_micro_batch: bool = False,
) -> int:
    """The smallest power-of-two node count (up to ``max_nodes``) with a runnable grid.

    For grid=auto without nodes. Raises PlanError with the reasons at ``max_nodes``.
    """
    nodes = 1
    while True:
        ranking = _ranking(machine, model, train, nodes, calibration, fixed_micro_batch)
        if ranking.rows:
            return nodes
        if nodes * 2 > max_nodes:
            raise PlanError(explain_empty(ranking, machine, model, nodes))
        nodes *= 2


def _ranking(machine, model, train, nodes, calibration, fixed_micro_batch) -> Ranking:
    if nodes < 1:
        raise PlanError(f"nodes={nodes}: must be a positive integer")
    world = nodes * machine.hardware.gpus_per_node
    return rank_grids(
        hardware=machine.hardware,
        model=model,
        train=train,
        world_size=world,
        calibration=calibration,
        fixed_micro_batch=fixed_micro_batch,
    )


def explain_empty(ranking: Ranking, machine: MachineProfile, model: ModelSpec, nodes: int) -> str:
    parts = [f"{n} x {kind} (e.g. {ranking.example[kind]})" for kind, n in ranking.rejected.items()]
    return (
        f"no grid of {nodes} node(s) of {machine.name} can run {model.name}: all "
        f"{ranking.considered} grids rejected: " + "; ".join(parts)
    )


# --------------------------------------------------------------------------- CLI

PLAN_KEYS = ("top", "output", "calibration")


@dataclass(frozen=True)
class PlanArgs:
    machine: MachineProfile
    model: ModelSpec
    train: TrainConfig
    nodes: int
    top: int
    output: str  # table | json
    calibration: Calibration | None
    fixed_micro_batch: bool


def parse_args(argv: list[str]) -> PlanArgs:
    """``top=``, ``output=`` and ``calibration=`` are the planner's own; everything else is
    a Hydra override composed exactly as the launcher composes it."""
    from axonn_launch.config import ConfigError, load

    own: dict[str, str] = {}
    overrides: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise PlanError(f"{arg!r}: expected key=value")
        if key in PLAN_KEYS:
            own[key] = value
        else:
            overrides.append(arg)
    try:
        cfg = load(overrides)
    except ConfigError as exc:
        raise PlanError(str(exc)) from exc
    output = own.get("output", "table")
    if output not in ("table", "json"):
        raise PlanError(f"output={output!r}; valid: table, json")
    cal = load_calibration(own["calibration"]) if own.get("calibration") else None
    pinned = any(o.lstrip("+").partition("=")[0] == "train.micro_batch" for o in overrides)
    return PlanArgs(
        machine=cfg.machine,
        model=cfg.model,
        train=cfg.train,
        nodes=_positive_int("nodes", str(1 if cfg.nodes is None else cfg.nodes)),
        top=_positive_int("top", own.get("top", "5")),
        output=output,
        calibration=cal,
        fixed_micro_batch=pinned,
    )


def _positive_int(key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise PlanError(f"{key}={text!r}: must be a positive integer")
    return value


def format_table(rows: list[PlanRow], peak: float) -> str:
    """The plan as aligned columns; the last ones split the step into compute and the
    exposed communication of each axis (xy = the vocab-parallel plane)."""
    head = ["rank", "grid (data,x,y,z)", "mb", "step s", "TFLOP/s/GPU", "% peak", "mem GiB"]
    head += ["compute s"] + [f"{a} s" for a in COMM_AXES]
    lines = [head]
    for r in rows:
        g = r.grid
        pct = f"{100 * r.fraction_of_peak:.1f}" if peak > 0 else "-"
        line = [str(r.rank), f"({g.data},{g.x},{g.y},{g.z})", str(r.micro_batch)]
        line += [f"{r.step_time_s:.4g}", f"{r.tflops_per_gpu:.4g}", pct, f"{r.memory_gib:.1f}"]
        line += [f"{r.compute_s:.4g}"] + [f"{r.comm_s[a]:.4g}" for a in COMM_AXES]
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in lines
    )


def run(args: PlanArgs) -> tuple[str, bool]:
    """(text to print, whether any grid was found)."""
    ranking = _ranking(
        args.machine, args.model, args.train, args.nodes, args.calibration, args.fixed_micro_batch
    )
    rows = ranking.rows[: args.top]
    hw, tr = args.machine.hardware, args.train
    world = args.nodes * hw.gpus_per_node
    if args.output == "json":
        payload = {
            "machine": args.machine.name,
            "model": args.model.name,
            "nodes": args.nodes,
            "world_size": world,
            "train": {
                "global_batch": tr.global_batch,
                "seq_len": tr.seq_len,
                "activation_checkpointing": tr.activation_checkpointing,
                "overlap": dataclasses.asdict(tr.overlap),
            },
            "calibration": args.calibration.source if args.calibration else None,
            "considered": ranking.considered,
            "rejected": ranking.rejected,
            "plans": [r.as_dict() for r in rows],
        }
        return json.dumps(payload, indent=2), bool(rows)
    header = (
        f"{args.model.name} on {args.nodes} node(s) of {args.machine.name} = {world} GPUs; "
        f"global_batch={tr.global_batch} seq_len={tr.seq_len} "
        f"activation_checkpointing={tr.activation_checkpointing}\n"
        f"{ranking.considered} grids, {len(ranking.rows)} runnable"
        + "".join(f", {n} rejected ({k})" for k, n in ranking.rejected.items())
    )
    if not rows:
        return header + "\n" + explain_empty(ranking, args.machine, args.model, args.nodes), False
    return header + "\n" + format_table(rows, hw.peak_tflops_per_gpu), True


def main(argv: list[str] | None = None) -> int:
    """Print the plan; exit status 0 with plans, 1 when no grid can run, 2 on bad input."""
    try:
        text, found = run(parse_args(sys.argv[1:] if argv is None else argv))
    except (PlanError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
