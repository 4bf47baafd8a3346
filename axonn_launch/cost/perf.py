"""Predicted time of one optimizer step for a (hardware, model, batch, grid) point.

AxoNN's communication model extended with compute, element-wise and latency terms, the
overlaps and the placement of each axis, so that ``plan`` can rank grids before any job
runs. ``step_time`` returns the compute time and the exposed (and raw) communication time
per axis: x, y, z, data and "xy" (the plane). Pure Python: the planner runs on login nodes
and must not import torch.

The model, its notation, ring costs, what it leaves out and its sources:
``docs/cost-model.md`` ("cost/perf.py").
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import Hardware
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.rules import local_vocab
from axonn_launch.common.spec import TrainConfig
from axonn_launch.common.traffic import (
    ALL_GATHER,
    ALL_REDUCE,
    BACKWARD,
    COLLECTIVES,
    FORWARD,
    REDUCE_SCATTER,
    Collective,
    WireBytes,
    block_collectives,
    block_linears,
    replicated_kv_elements,
    tokens_per_gpu,
    wire_bytes,
)
from axonn_launch.cost.memory import local_param_elements, replicated_over_z_elements

__all__ = ["ALL_GATHER", "ALL_REDUCE", "COLLECTIVES", "REDUCE_SCATTER"]  # re-exported

# Breakdown keys: the four grid axes plus the x*y plane (vocab-parallel embedding and loss).
COMM_AXES = ("x", "y", "z", "data", "xy")

# Uncited defaults, each named as such where plan prints what it assumed. The GEMM efficiency
# stands in only where a profile measured none (hardware.gemm_efficiency, cited per machine);
# the overlap efficiency until calibrate measures it (measure_overlap): no published value for
# NCCL or RCCL on these machines was found (../shared/reference/planner_audit.md §2, §5.3).
DEFAULT_GEMM_EFFICIENCY = 0.75  # fraction of dense peak a large bf16 GEMM reaches
DEFAULT_KERNEL_OVERHEAD_US = 2.0  # fixed cost per GEMM call (launch, tail effects)
DEFAULT_OVERLAP_EFFICIENCY = 1.0  # communication overlaps compute fully (own engines)
OVERLAP_RANGE = (0.0, 1.0)  # what plan brackets while e is unmeasured: serial to perfect
NOMINAL_CPU_TFLOPS = 0.05  # used only when the hardware has no peak and nothing was measured
PLAIN_FORMULATION = "direct"  # the tuner's name for a @ b on the operands as given (gemm.py)
GEMM_OPS = ("fwd", "dx", "dw")


# --------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class BandwidthSample:
    """One measured collective: bus bandwidth and per-step latency of a group layout."""

    collective: str  # all_reduce | all_gather | reduce_scatter
    size: int  # ranks in the group
    per_node: int  # ranks of one group that share a node (== size: inside one node)
    bus_gbps: float
    alpha_us: float

    @property
    def intra_node(self) -> bool:
        return self.per_node >= self.size


@dataclass(frozen=True)
class Calibration:
    """Measured numbers that replace the nominal ones of ``Hardware``.

    ``gemm_shapes`` maps a GEMM shape (op, m, n, k) to the TFLOP/s of each formulation
    measured for it (``calibrate.measure_gemm_shapes``; "direct" is the plain a @ b).
    ``gemm`` holds (FLOPs per GEMM call, achieved TFLOP/s) pairs of square GEMMs; between
    them the throughput is interpolated in log(FLOPs). Without either the GEMM time is
    FLOPs / (peak * gemm_efficiency) + kernel_overhead_us.
    """

    gemm_efficiency: float = DEFAULT_GEMM_EFFICIENCY
    kernel_overhead_us: float = DEFAULT_KERNEL_OVERHEAD_US
    overlap_efficiency: float = DEFAULT_OVERLAP_EFFICIENCY
    # the measured (lowest, highest) efficiency the profile cites; None: not from a profile
    gemm_efficiency_range: tuple[float, float] | None = None
    overlap_measured: bool = False  # False: overlap_efficiency is the uncited default
    gemm: tuple[tuple[float, float], ...] = ()
    gemm_shapes: dict[tuple[str, int, int, int], dict[str, float]] = field(default_factory=dict)
    elementwise: tuple[tuple[float, float], ...] = ()  # (bytes per kernel, GB/s)
    collectives: tuple[BandwidthSample, ...] = ()
    source: str = ""  # where the numbers come from (a file path), for reports

    def gemm_tflops(self, flops: float) -> float | None:
        """Achieved TFLOP/s for a GEMM of ``flops``, interpolated from measurements."""
        return log_interpolate(self.gemm, flops)

    def shape_tflops(self, gemm: Gemm, *, tuned: bool) -> float | None:
        """Measured TFLOP/s of this exact shape: the fastest formulation when the job
        tunes, else the plain one; None when the shape (or the plain one) was not measured."""
        rates = self.gemm_shapes.get(gemm.key)
        if not rates:
            return None
        return max(rates.values()) if tuned else rates.get(PLAIN_FORMULATION)

    def memory_gbps(self, kernel_bytes: float) -> float | None:
        """Element-wise GB/s for kernels moving ``kernel_bytes``, from measurements."""
        return log_interpolate(self.elementwise, kernel_bytes)

    @functools.cached_property
    def _exact(self) -> dict[tuple[str, int, int], BandwidthSample]:
        found: dict[tuple[str, int, int], BandwidthSample] = {}
        for c in self.collectives:
            found.setdefault((c.collective, c.size, c.per_node), c)
        return found

    def bandwidth_sample(self, collective: str, size: int, per_node: int) -> BandwidthSample | None:
        """The measured sample closest to this group layout.

        Exact (collective, size, per_node) first; otherwise the same collective with the
        same per-node count and placement (inside / across nodes), nearest in log(size).
        """
        exact = self._exact.get((collective, size, per_node))
        if exact is not None:
            return exact
        same = [c for c in self.collectives if c.collective == collective]
        intra = per_node >= size
        alike = [c for c in same if c.intra_node == intra and (intra or c.per_node == per_node)]
        if not alike:
            return None
        return min(alike, key=lambda c: abs(math.log2(c.size) - math.log2(size)))


def log_interpolate(points: tuple[tuple[float, float], ...], x: float) -> float | None:
    """y at ``x`` from (x, y) points, linear in log(x) between them, clamped at the ends."""
    if not points:
        return None
    points = tuple(sorted(points))
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return points[-1][1]


def load_calibration(path: str | Path, base: Calibration | None = None) -> Calibration:
    """Read the JSON file written by ``axonn_launch.calibrate``; what it did not measure
    stays as in ``base`` (the machine profile's ``profile_calibration``)."""
    base = base or Calibration()
    raw = json.loads(Path(path).read_text())
    samples = tuple(
        BandwidthSample(
            collective=c["collective"],
            size=int(c["size"]),
            per_node=int(c["per_node"]),
            bus_gbps=float(c["bus_gbps"]),
            alpha_us=float(c["alpha_us"]),
        )
        for c in raw.get("collectives", [])
    )
    gemm = tuple((float(f), float(r)) for f, r in raw.get("gemm", []))
    shapes = {
        (str(g["op"]), int(g["m"]), int(g["n"]), int(g["k"])): {
            str(name): float(rate) for name, rate in g["tflops"].items()
        }
        for g in raw.get("gemm_shapes", [])
    }
    overlap = raw.get("overlap", {})
    gemm_measured = bool(gemm or shapes or "gemm_efficiency" in raw)
    return Calibration(
        gemm_efficiency=float(raw.get("gemm_efficiency", base.gemm_efficiency)),
        kernel_overhead_us=float(raw.get("kernel_overhead_us", base.kernel_overhead_us)),
        overlap_efficiency=float(overlap.get("efficiency", base.overlap_efficiency)),
        gemm_efficiency_range=None if gemm_measured else base.gemm_efficiency_range,
        overlap_measured="efficiency" in overlap or base.overlap_measured,
        elementwise=tuple((float(b), float(r)) for b, r in raw.get("elementwise", []))
        or base.elementwise,
        gemm=gemm,
        gemm_shapes=shapes,
        collectives=samples or base.collectives,
        source=str(path),
    )


def profile_calibration(hardware: Hardware) -> Calibration:
    """What the planner assumes without a calibration file: the GEMM efficiency and bus
    bandwidths the machine profile measured and cites (``hardware.gemm_efficiency``, planned
    at its lowest; ``hardware.bus_gbps``), else the uncited defaults and nominal links."""
    measured = hardware.gemm_efficiency
    return Calibration(
        gemm_efficiency=min(measured) if measured else DEFAULT_GEMM_EFFICIENCY,
        gemm_efficiency_range=(min(measured), max(measured)) if measured else None,
        collectives=table_samples(hardware.bus_gbps, hardware.gpus_per_node, hardware.latency_us),
    )


MAX_TABLE_RANKS = 65536  # table_samples lists group layouts up to this many ranks


def table_samples(
    rows: list[list[float]], gpus_per_node: int, latency_us: float
) -> tuple[BandwidthSample, ...]:
    """A bus bandwidth table as AxoNN measured it (Megatron-AxoNN comm_model.py ``get_bw``):
    rows [ip, GB/s for 2, 4, 8, >= 16 ranks], ip being the product of the sizes of the axes
    inside this one (its stride), a row standing for every ip up to the next. One sample per
    (group size, ranks per node) of each collective, from the smallest ip that gives that
    layout, with the profile's latency."""
    if not rows:
        return ()
    found: dict[tuple[int, int], float] = {}
    size = 2
    while size <= MAX_TABLE_RANKS:
        ip = 1
        while ip * size <= MAX_TABLE_RANKS:
            row = max((r for r in rows if r[0] <= ip), key=lambda r: r[0], default=rows[0])
            column = 1 + min(int(size).bit_length() - 2, 3)  # size 2, 4, 8, >= 16
            per_node = (
                size if ip * size <= gpus_per_node else max(1, min(size, gpus_per_node // ip))
            )
            found.setdefault((size, per_node), float(row[column]))
            ip *= 2
        size *= 2
    return tuple(
        BandwidthSample(c, size=p, per_node=k, bus_gbps=bw, alpha_us=latency_us)
        for (p, k), bw in found.items()
        for c in COLLECTIVES
    )


def bounds(cal: Calibration) -> tuple[Calibration, Calibration]:
    """(slowest, fastest) ends of the inputs that are not measured on the machine: the GEMM
    efficiency over the profile's cited range, and the overlap efficiency over
    ``OVERLAP_RANGE`` while it is the uncited default."""
    low, high = cal.gemm_efficiency_range or (cal.gemm_efficiency, cal.gemm_efficiency)
    e_low, e_high = (cal.overlap_efficiency,) * 2 if cal.overlap_measured else OVERLAP_RANGE
    slow = replace(cal, gemm_efficiency=low, overlap_efficiency=e_low)
    return slow, replace(cal, gemm_efficiency=high, overlap_efficiency=e_high)


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """Where the ranks of one group along an axis sit."""

    size: int  # ranks in the group
    per_node: int  # ranks of the group on one node

    @property
    def intra_node(self) -> bool:
        return self.per_node >= self.size


def placement(grid: Grid, axis: str, gpus_per_node: int, size: int | None = None) -> Placement:
    """Group layout of ``axis``: ranks are numbered x fastest, then y, z, data (grid.py).
    ``size``: a group of that many consecutive ranks of the axis instead of all of them.

    A group stays inside one node iff stride * size <= gpus_per_node. Otherwise it spans
    nodes with gpus_per_node // stride members per node (at least one).
    """
    if axis == "xy":
        full, stride = grid.x * grid.y, 1
    else:
        full, stride = grid.size(axis), grid.stride(axis)
    size = full if size is None else size
    gpn = max(1, gpus_per_node)
    if stride * size <= gpn:
        return Placement(size=size, per_node=size)
    return Placement(size=size, per_node=max(1, min(size, gpn // stride)))


def bus_bandwidth(
    hw: Hardware, place: Placement, collective: str, cal: Calibration | None = None
) -> tuple[float, float]:
    """(bus bandwidth in GB/s, alpha in seconds per ring step) for one group layout.

    Measured samples win. Otherwise: inside a node, the NVLink/Infinity-Fabric bandwidth
    per GPU. Across nodes, all groups of an axis run their collective at the same time,
    so a node's injection bandwidth (gpus_per_node * inter_node_gbps) is shared by the
    gpus_per_node / per_node groups that touch it: each ring gets per_node *
    inter_node_gbps, and never more than the intra-node links carry.
    """
    sample = cal.bandwidth_sample(collective, place.size, place.per_node) if cal else None
    if sample is not None:
        return sample.bus_gbps, sample.alpha_us * 1e-6
    intra = hw.intra_node_gbps if hw.intra_node_gbps > 0 else math.inf
    gbps = intra if place.intra_node else min(intra, place.per_node * hw.inter_node_gbps)
    if not math.isfinite(gbps) or gbps <= 0:
        raise ValueError(
            f"no bandwidth for a group of {place.size} ({place.per_node} per node): set "
            "hardware.intra_node_gbps / inter_node_gbps or pass a calibration"
        )
    return gbps, hw.latency_us * 1e-6


def ring_time(collective: str, p: int, nbytes: float, gbps: float, alpha_s: float) -> float:
    """Ring cost of one collective over ``p`` ranks; ``nbytes`` is the full (gathered) size."""
    if p <= 1:
        return 0.0
    if collective == ALL_REDUCE:
        steps, factor = 2 * (p - 1), 2 * (p - 1) / p
    elif collective in (ALL_GATHER, REDUCE_SCATTER):
        steps, factor = p - 1, (p - 1) / p
    else:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    return steps * alpha_s + factor * nbytes / (gbps * 1e9)


# --------------------------------------------------------------------------- compute


@dataclass(frozen=True)
class Gemm:
    """One GEMM C[m, n] = A[m, k] @ B[k, n] of the training core, per GPU."""

    op: str  # fwd | dx | dw
    linear: str  # qkv | proj | fc1 | fc2 | head
    m: int
    n: int
    k: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.op, self.m, self.n, self.k)


def linear_gemms(linear: str, tokens: int, rows: int, cols: int) -> tuple[Gemm, Gemm, Gemm]:
    """The three GEMMs of a Linear whose local weight block is [rows, cols] (out, in):
    forward Y = X W^T, dX = dY W, dW = dY^T X, with X of ``tokens`` rows."""
    return (
        Gemm("fwd", linear, tokens, rows, cols),
        Gemm("dx", linear, tokens, cols, rows),
        Gemm("dw", linear, rows, cols, tokens),
    )


def block_gemms(model: ModelSpec, grid: Grid, tokens: float) -> tuple[Gemm, ...]:
    """Forward, dX and dW GEMMs of the four Linears of a block at the local block sizes
    (fan_out/outer x fan_in/inner, axonn.md §2.3) for T = ``tokens``."""
    out: list[Gemm] = []
    for lin in block_linears(model):
        rows = lin.fan_out // lin.out_split(grid)
        cols = lin.fan_in // grid.size(lin.inner)
        out += linear_gemms(lin.name, int(tokens), rows, cols)
    return tuple(out)


def head_gemms(model: ModelSpec, grid: Grid, tokens: float) -> tuple[Gemm, ...]:
    """The LM head: logits [T, V/(x*y)] = hidden [T, h] @ table block^T (the token
    table's block when tied, the head's own of the same layout when not)."""
    return linear_gemms("head", int(tokens), local_vocab(model.vocab_size, grid), model.d_model)


def planned_gemms(model: ModelSpec, grid: Grid, train: TrainConfig) -> tuple[Gemm, ...]:
    """Every distinct GEMM shape a micro-step of this grid runs (what calibrate measures)."""
    tokens = tokens_per_gpu(train, grid)
    return block_gemms(model, grid, tokens) + head_gemms(model, grid, tokens)


def gemm_seconds(flops: float, hw: Hardware, cal: Calibration) -> float:
    """Time of one GEMM call of ``flops`` on one GPU, from its FLOPs alone."""
    if flops <= 0:
        return 0.0
    measured = cal.gemm_tflops(flops)
    if measured is not None:
        return flops / (measured * 1e12)
    peak = hw.peak_tflops_per_gpu if hw.peak_tflops_per_gpu > 0 else NOMINAL_CPU_TFLOPS
    return flops / (peak * cal.gemm_efficiency * 1e12) + cal.kernel_overhead_us * 1e-6


def shaped_gemm_seconds(gemm: Gemm, hw: Hardware, cal: Calibration, *, tuned: bool) -> float:
    """Time of one GEMM: its shape's measured rate if calibrated, else ``gemm_seconds``."""
    rate = cal.shape_tflops(gemm, tuned=tuned)
    if rate:
        return gemm.flops / (rate * 1e12)
    return gemm_seconds(gemm.flops, hw, cal)


# Element passes (one read or one write of an element) per token of the element-wise
# kernels: a layer's forward is its architecture's (``Architecture.elementwise_passes``).
BACKWARD_FACTOR = 2  # a backward kernel reads the output gradient and the saved input
LOSS_PASSES = 6  # softmax cross-entropy: max, exp, sum, normalize; its gradient


def elementwise_elements(model: ModelSpec, grid: Grid) -> tuple[float, float]:
    """(per layer forward, head forward + backward) element passes per token.

    The residual stream is split over x (h/x per token), the attention heads and the MLP's
    hidden over y (3h/y, h/y, f/y), the vocabulary over the x*y plane.
    """
    head = LOSS_PASSES * model.vocab_size / (grid.x * grid.y)
    return model.architecture.elementwise_passes(model, grid), head


# --------------------------------------------------------------------------- the step


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on one GPU, with the communication split per axis."""

    compute: float
    comm: dict[str, float]  # exposed (after overlap), by axis in COMM_AXES
    comm_raw: dict[str, float]  # before overlap
    accumulation: int  # micro-steps per optimizer step
    model_flops_per_gpu: float  # ModelSpec.flops_per_token * tokens / world_size
    peak_tflops: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + sum(self.comm.values())

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops_per_gpu / self.total / 1e12

    @property
    def fraction_of_peak(self) -> float:
        return self.tflops_per_gpu / self.peak_tflops if self.peak_tflops > 0 else 0.0


@dataclass
class _Ledger:
    """Raw and exposed seconds per axis."""

    raw: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMM_AXES, 0.0))
    exposed: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMM_AXES, 0.0))

    def add(self, axis: str, raw: float, exposed: float | None = None) -> None:
        self.raw[axis] += raw
        self.exposed[axis] += raw if exposed is None else exposed

    def scaled(self, k: float) -> _Ledger:
        return _Ledger(
            raw={a: v * k for a, v in self.raw.items()},
            exposed={a: v * k for a, v in self.exposed.items()},
        )

    def merge(self, other: _Ledger) -> None:
        for a in COMM_AXES:
            self.raw[a] += other.raw[a]
            self.exposed[a] += other.exposed[a]


def partly_hidden(raw: float, exposed_if_perfect: float, efficiency: float) -> float:
    """Exposed time when overlap hides only ``efficiency`` of what it could hide."""
    return raw - efficiency * (raw - exposed_if_perfect)


def stream_exposed(segments: list[tuple[int, float, float]]) -> float:
    """Exposed time of collectives run one after another on one link, each able to hide
    behind the compute that follows its own chunk.

    ``segments`` lists runs of equal chunks in issue order: (count, comm c, compute b).
    Collective k starts once its chunk starts (a prefetch one chunk ahead, or a
    reduce-scatter issued when its gradient is ready) and after collective k-1; the last
    one ends max over k of (C_k.. - B_k+1..) after the compute, C_k.. being the comm of
    chunks k to the end and B_k+1.. the compute after chunk k. Within a run the
    expression is linear in where k sits, so only the runs' ends need checking. For one
    run of n chunks: c + (n-1) * max(0, c - b): one chunk is always exposed, the others
    only by what exceeds the compute they hide behind.
    """
    best, comm_after, compute_after = 0.0, 0.0, 0.0
    for count, comm, compute in reversed(segments):
        if count <= 0:
            continue
        for m in (1, count):  # suffix starting at this run's last or first chunk
            best = max(best, comm_after + m * comm - compute_after - (m - 1) * compute)
        comm_after += count * comm
        compute_after += count * compute
    return best


def pipelined_exposed(chunk_comm: float, chunk_compute: float, n: int) -> float:
    """``stream_exposed`` of one run of n equal chunks."""
    return stream_exposed([(n, chunk_comm, chunk_compute)]) if chunk_comm > 0 else 0.0


class _Costs:
    """Collective and GEMM times for one grid, with bandwidths looked up once per axis."""

    def __init__(self, hw: Hardware, grid: Grid, cal: Calibration, *, tuned: bool) -> None:
        self.hw, self.grid, self.cal, self.tuned = hw, grid, cal, tuned
        self._bw: dict[tuple[str, str], tuple[float, float, int]] = {}

    def coll(self, collective: str, axis: str, nbytes: float) -> float:
        key = (collective, axis)
        if key not in self._bw:
            place = placement(self.grid, axis, self.hw.gpus_per_node)
            if place.size <= 1:
                self._bw[key] = (1.0, 0.0, 1)
            else:
                gbps, alpha = bus_bandwidth(self.hw, place, collective, self.cal)
                self._bw[key] = (gbps, alpha, place.size)
        gbps, alpha, p = self._bw[key]
        return ring_time(collective, p, nbytes, gbps, alpha)

    def group(self, collective: str, axis: str, size: int, nbytes: float) -> float:
        """A collective over ``size`` consecutive ranks of ``axis`` (not looked up once)."""
        place = placement(self.grid, axis, self.hw.gpus_per_node, size)
        if place.size <= 1:
            return 0.0
        gbps, alpha = bus_bandwidth(self.hw, place, collective, self.cal)
        return ring_time(collective, place.size, nbytes, gbps, alpha)

    def collective(self, c: Collective) -> float:
        return self.coll(c.op, c.axis, c.nbytes)

    def gemm(self, gemm: Gemm) -> float:
        return shaped_gemm_seconds(gemm, self.hw, self.cal, tuned=self.tuned)

    def flops(self, flops: float) -> float:
        """A GEMM known by its FLOPs only (the fused attention core)."""
        return gemm_seconds(flops, self.hw, self.cal)

    def memory(self, nbytes: float, kernel_bytes: float) -> float:
        """Seconds to stream ``nbytes`` through element-wise kernels that each move about
        ``kernel_bytes`` (measured bandwidth, else the hardware's; 0 if unknown)."""
        gbps = self.cal.memory_gbps(kernel_bytes) or self.hw.memory_gbps
        return nbytes / (gbps * 1e9) if gbps > 0 else 0.0


def step_time(
    *,
    hardware: Hardware,
    model: ModelSpec,
    train: TrainConfig,
    grid: Grid,
    calibration: Calibration | None = None,
) -> StepTime:
    """Predicted seconds per optimizer step: ``accumulation`` micro-steps plus the
    once-per-step gradient synchronization (see the module docstring)."""
    cal = calibration or profile_calibration(hardware)
    costs = _Costs(hardware, grid, cal, tuned=train.gemm_tuning)
    gpu = hardware.runs_on_gpu
    compute, micro = _micro_step(costs, model, train, grid, gpu)
    accum = max(1, train.accumulation_steps(grid))
    ledger = micro.scaled(accum)
    ledger.merge(_gradient_sync(costs, model, grid, wire_bytes(train, on_gpu=gpu)))
    model_flops = (
        model.flops_per_token(train.seq_len, recompute=train.activation_checkpointing)
        * train.global_batch
        * train.seq_len
        / grid.world_size
    )
    return StepTime(
        compute=compute * accum,
        comm=dict(ledger.exposed),
        comm_raw=dict(ledger.raw),
        accumulation=accum,
        model_flops_per_gpu=model_flops,
        peak_tflops=hardware.peak_tflops_per_gpu,
    )


@dataclass(frozen=True)
class _LayerCompute:
    """Seconds of one layer's work on one GPU, per pass."""

    forward: float  # GEMMs, attention core and element-wise kernels of one forward
    backward: float  # dX and dW GEMMs, attention and element-wise backward
    dw: dict[str, float]  # dW GEMM per Linear (what OAR hides each dX all-reduce behind)


def _layer_compute(costs: _Costs, model: ModelSpec, grid: Grid, train: TrainConfig, wire):
    """Each Linear's forward, dX and dW GEMMs at their shapes (``block_gemms``). The
    attention core has its heads split over y and is repeated on every x rank: QK^T and
    AV are 2 * 2*T*s*h/y FLOPs forward (the s/(6h) term of Narayanan's formula), twice
    that backward."""
    tokens = tokens_per_gpu(train, grid)
    times: dict[str, float] = dict.fromkeys(GEMM_OPS, 0.0)
    dw: dict[str, float] = {}
    for g in block_gemms(model, grid, tokens):
        t = costs.gemm(g)
        times[g.op] += t
        if g.op == "dw":
            dw[g.linear] = t
    attn = costs.flops(4 * tokens * train.seq_len * model.d_model / grid.y)
    per_layer, _ = elementwise_elements(model, grid)
    kernel = 3 * tokens * model.d_model / grid.x * wire.compute  # a residual add
    ew = costs.memory(tokens * per_layer * wire.compute, kernel)
    backward = times["dx"] + times["dw"] + 2 * attn + BACKWARD_FACTOR * ew
    return _LayerCompute(forward=times["fwd"] + attn + ew, backward=backward, dw=dw)


@dataclass
class _BlockComm:
    """One block's communication in one micro-step, priced (seconds)."""

    raw: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("x", "y", "z"), 0.0))
    exposed_xy: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("x", "y"), 0.0))
    forward_blocking: float = 0.0  # forward-pass all-reduces (the compute waits for them)
    recompute_blocking: float = 0.0
    backward_exposed: float = 0.0  # backward x/y all-reduces not hidden by OAR
    z_forward: float = 0.0  # overlapped z collectives of the forward (OAG's gathers)
    z_backward: float = 0.0  # overlapped z collectives of recompute + backward (OAG, ORS)
    z_blocking: float = 0.0  # z collectives nothing hides (an overlap switched off)


def _price_block(costs: _Costs, colls: tuple[Collective, ...], lc: _LayerCompute, train):
    """Sort one block's collectives into what waits, what OAR hides behind its Linear's
    dW GEMM, and what the z streams carry."""
    ov, e = train.overlap, costs.cal.overlap_efficiency
    out = _BlockComm()
    for c in colls:
        t = costs.collective(c)
        out.raw[c.axis] += t
        if c.axis == "z":
            overlapped = ov.reduce_scatter if c.op == REDUCE_SCATTER else ov.all_gather
            if not overlapped:
                out.z_blocking += t
            elif c.phase == FORWARD:
                out.z_forward += t
            else:
                out.z_backward += t
            continue
        exposed = t
        if c.phase == BACKWARD and c.op == ALL_REDUCE and c.linear in lc.dw and ov.all_reduce:
            exposed = partly_hidden(t, max(0.0, t - lc.dw[c.linear]), e)  # OAR
        out.exposed_xy[c.axis] += exposed
        if c.phase == FORWARD:
            out.forward_blocking += t
        elif c.phase == BACKWARD:
            out.backward_exposed += exposed
        else:
            out.recompute_blocking += t
    return out


def _micro_step(
    costs: _Costs, model: ModelSpec, train: TrainConfig, grid: Grid, gpu: bool
) -> tuple[float, _Ledger]:
    """Compute seconds and communication ledger of one micro-step (forward + backward).

    The first ``cache_layers`` blocks (cached) and the others differ only in their z
    gathers; each kind is priced once (``_price_block``) and counted per block.
    """
    wire = wire_bytes(train, on_gpu=gpu)
    lc = _layer_compute(costs, model, grid, train, wire)
    recompute = lc.forward if train.activation_checkpointing else 0.0
    cached = min(train.cache_layers or 0, model.n_layer)
    # in backward order: the uncached last blocks first, the cached first blocks last (the
    # forward's segments are alike for both kinds, so their order does not matter)
    kinds = [(model.n_layer - cached, False), (cached, True)]
    ledger = _Ledger()
    forward_segments, backward_segments = [], []
    blocking_z = 0.0
    for count, is_cached in kinds:
        if count == 0:
            continue
        colls = block_collectives(model, grid, train, on_gpu=gpu, cached=is_cached)
        bc = _price_block(costs, colls, lc, train)
        for axis in ("x", "y"):
            ledger.add(axis, count * bc.raw[axis], count * bc.exposed_xy[axis])
        ledger.add("z", count * bc.raw["z"], 0.0)  # exposed z: below, from the streams
        blocking_z += count * bc.z_blocking
        n = len(block_linears(model))  # the streams advance one Linear at a time
        fwd_busy = lc.forward + bc.forward_blocking
        bwd_busy = lc.backward + bc.backward_exposed + recompute + bc.recompute_blocking
        forward_segments.append((n * count, bc.z_forward / n, fwd_busy / n))
        backward_segments.append((n * count, bc.z_backward / n, bwd_busy / n))
    ledger.exposed["z"] += blocking_z + _z_streams(costs, forward_segments, backward_segments)
    head = _embedding_and_head(costs, model, grid, train, ledger, wire)
    compute = model.n_layer * (lc.forward + recompute + lc.backward)  # caching keeps weights,
    return compute + head, ledger  # not activations: every block still recomputes


def _z_streams(costs: _Costs, forward: list, backward: list) -> float:
    """Exposed seconds of the two overlapped z streams of a micro-step.

    Forward: the prefetched gathers, one Linear ahead, behind the forward work. Backward
    (blocks in reverse order, so the cached first blocks come last): the recompute and
    backward gathers of the uncached blocks and every block's deferred reduce-scatters,
    behind the recompute and backward work. The ORS window (``train.ors_window``) bounds
    the reduce-scatters queued on the link: when the queue is full the compute waits,
    but the link stays busy, so what the stream leaves exposed is the same (it changes
    memory, memory.py).
    """
    e = costs.cal.overlap_efficiency
    exposed = 0.0
    for segments in (forward, backward):
        raw = sum(count * comm for count, comm, _ in segments)
        if raw > 0:
            exposed += partly_hidden(raw, stream_exposed(segments), e)
    return exposed


def _embedding_and_head(costs, model, grid, train, ledger, wire: WireBytes) -> float:
    """Vocab-parallel token table over the x*y plane (axonn.md §2.5, the training core's
    layout); returns its compute seconds and books its traffic.

    z: the table block V/(x*y)*h is all-gathered in the forward (``wire.all_gather``)
    and its gradient reduce-scattered in the backward (``wire.reduce_scatter``), not
    overlapped. Plane: the embedding sum (T*h, fp32) in the forward, the LM head's dX
    (T*h, fp32) in the backward, the loss's max (T) and sums (2T). x: the hidden states
    gathered for the LM head (T*h) in the forward, their gradient gathered in the
    backward. LM head GEMMs at their shapes (``head_gemms``); the loss's element-wise
    passes at the memory bandwidth, in fp32.
    """
    h, tokens = model.d_model, tokens_per_gpu(train, grid)
    rows = local_vocab(model.vocab_size, grid)
    table = rows * h
    z = costs.coll(ALL_GATHER, "z", table * wire.all_gather)
    z += costs.coll(REDUCE_SCATTER, "z", table * wire.reduce_scatter)
    ledger.add("z", model.vocab_tables * z)
    plane = 2 * costs.coll(ALL_REDUCE, "xy", tokens * h * 4)
    plane += costs.coll(ALL_REDUCE, "xy", tokens * 4) + costs.coll(ALL_REDUCE, "xy", 2 * tokens * 4)
    ledger.add("xy", plane)
    ledger.add("x", 2 * costs.coll(ALL_GATHER, "x", tokens * h * 4))
    _, head_passes = elementwise_elements(model, grid)
    logits = tokens * rows * 4  # the loss runs in fp32
    loss = costs.memory(tokens * head_passes * 4, 2 * logits)
    return sum(costs.gemm(g) for g in head_gemms(model, grid, tokens)) + loss


def _gradient_sync(costs: _Costs, model: ModelSpec, grid: Grid, wire: WireBytes) -> _Ledger:
    """Once per step, not overlapped (``finish_gradients``; Megatron-AxoNN likewise refuses
    --overlap-grad-reduce, axonn.md §2.6): one coalesced all-reduce over z of the
    gradients replicated over z (biases, norms, positions), one over each group of y
    ranks holding the same KV heads (Llama with y > n_kv_head) of those blocks' z
    shards, then one over data of every local gradient, fp32 whatever the wire dtypes."""
    ledger = _Ledger()
    replicated = replicated_over_z_elements(model, grid) * wire.grad
    ledger.add("z", costs.coll(ALL_REDUCE, "z", replicated))
    kv = model.n_layer * replicated_kv_elements(model, grid) / grid.z * wire.grad
    if kv:
        replicas = max(lin.replicas(grid) for lin in block_linears(model))
        ledger.add("y", costs.group(ALL_REDUCE, "y", replicas, kv))
    ledger.add(
        "data", costs.coll(ALL_REDUCE, "data", local_param_elements(model, grid) * wire.grad)
    )
    return ledger
