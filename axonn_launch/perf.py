"""Predicted time of one optimizer step for a (hardware, model, batch, grid) point.

The model follows AxoNN's 3D tensor-parallel GPT layer (reference axonn.md §2.3-§2.7) as
the training core (``axonn_launch.train``) runs it, and extends the bandwidth-only model
of Megatron-AxoNN's ``comm_model.py`` (§4.1) with

* a compute term: the per-GPU FLOPs of every GEMM at a throughput that calibration sets
  (``Calibration``; default: a fraction of the dense peak plus a fixed cost per call);
* an element-wise term: the bytes LayerNorm, residual adds, GeLU, layout copies and the
  loss's softmax read and write (``elementwise_elements``) at the memory bandwidth
  (measured per kernel size by calibration, else ``Hardware.memory_gbps``; without
  either the term is left out);
* a latency term per ring step (alpha);
* the exact per-GEMM volumes of §2.7, i.e. with the §4.3 correction for the MLP
  down-projection (its forward all-reduce runs over y with T*h/x elements, its backward
  all-reduce over x with T*4h/y elements);
* bandwidths that follow where an axis's ranks sit (x innermost, then y, z, data);
* the three overlaps of §3.1 (OAR, ORS, OAG) subtracting what they hide, scaled by the
  overlap efficiency e that calibration measures (``Calibration.overlap_efficiency``:
  the fraction of the shorter of a collective and a GEMM that disappears when they run
  at the same time; 1 where communication has its own engines, near 0 where it needs
  the same cores as the GEMMs, as with gloo on a CPU with more ranks than cores):
  exposed = raw - e * (raw - exposed with perfect overlap);
* the traffic around the blocks: vocab-parallel embedding and loss over the x*y plane,
  LayerNorm statistics over x, and the once-per-step z and data gradient all-reduces.

``step_time`` returns the compute time and the exposed (and raw) communication time
per axis: x, y, z, data and "xy" (the plane).

Notation used in the comments: T = tokens per GPU per micro-step = (micro_batch / z) * s,
h = d_model, f = d_ff, V = vocabulary, l = layers.

Ring costs (axonn.md §2.7): for p ranks and a message of M bytes (the full, gathered size)
    all-reduce:                     2(p-1) * alpha + 2(p-1)/p * M / B
    all-gather, reduce-scatter:      (p-1) * alpha +  (p-1)/p * M / B
with B the bus bandwidth of the group (``bus_bandwidth``).

Left out: the optimizer update, per-kernel launch and dispatch costs, contention between
collectives running at the same time on different axes, network congestion beyond the
per-node injection share, and NCCL's tree algorithms (everything is a ring).

Pure Python: the planner runs on login nodes and must not import torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from axonn_launch.grid import Grid
from axonn_launch.machine import Hardware
from axonn_launch.memory import local_param_elements, replicated_over_z_elements
from axonn_launch.models import ModelSpec
from axonn_launch.rules import local_vocab
from axonn_launch.spec import TrainConfig

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)

# Breakdown keys: the four grid axes plus the x*y plane (vocab-parallel embedding and loss).
COMM_AXES = ("x", "y", "z", "data", "xy")

DEFAULT_GEMM_EFFICIENCY = 0.75  # fraction of dense peak a large bf16 GEMM reaches
DEFAULT_KERNEL_OVERHEAD_US = 2.0  # fixed cost per GEMM call (launch, tail effects)
DEFAULT_OVERLAP_EFFICIENCY = 1.0  # communication overlaps compute fully (own engines)
NOMINAL_CPU_TFLOPS = 0.05  # used only when the hardware has no peak and nothing was measured


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

    ``gemm`` holds (FLOPs per GEMM call, achieved TFLOP/s) pairs; between them the
    throughput is interpolated in log(FLOPs). Without them the GEMM time is
    FLOPs / (peak * gemm_efficiency) + kernel_overhead_us.
    """

    gemm_efficiency: float = DEFAULT_GEMM_EFFICIENCY
    kernel_overhead_us: float = DEFAULT_KERNEL_OVERHEAD_US
    overlap_efficiency: float = DEFAULT_OVERLAP_EFFICIENCY
    gemm: tuple[tuple[float, float], ...] = ()
    elementwise: tuple[tuple[float, float], ...] = ()  # (bytes per kernel, GB/s)
    collectives: tuple[BandwidthSample, ...] = ()
    source: str = ""  # where the numbers come from (a file path), for reports

    def gemm_tflops(self, flops: float) -> float | None:
        """Achieved TFLOP/s for a GEMM of ``flops``, interpolated from measurements."""
        return log_interpolate(self.gemm, flops)

    def memory_gbps(self, kernel_bytes: float) -> float | None:
        """Element-wise GB/s for kernels moving ``kernel_bytes``, from measurements."""
        return log_interpolate(self.elementwise, kernel_bytes)

    def bandwidth_sample(self, collective: str, size: int, per_node: int) -> BandwidthSample | None:
        """The measured sample closest to this group layout.

        Exact (collective, size, per_node) first; otherwise the same collective with the
        same per-node count and placement (inside / across nodes), nearest in log(size).
        """
        same = [c for c in self.collectives if c.collective == collective]
        for c in same:
            if c.size == size and c.per_node == per_node:
                return c
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


def load_calibration(path: str | Path) -> Calibration:
    """Read the JSON file written by ``axonn_launch.calibrate``."""
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
    return Calibration(
        gemm_efficiency=float(raw.get("gemm_efficiency", DEFAULT_GEMM_EFFICIENCY)),
        kernel_overhead_us=float(raw.get("kernel_overhead_us", DEFAULT_KERNEL_OVERHEAD_US)),
        overlap_efficiency=float(
            raw.get("overlap", {}).get("efficiency", DEFAULT_OVERLAP_EFFICIENCY)
        ),
        elementwise=tuple((float(b), float(r)) for b, r in raw.get("elementwise", [])),
        gemm=gemm,
        collectives=samples,
        source=str(path),
    )


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """Where the ranks of one group along an axis sit."""

    size: int  # ranks in the group
    per_node: int  # ranks of the group on one node

    @property
    def intra_node(self) -> bool:
        return self.per_node >= self.size


def placement(grid: Grid, axis: str, gpus_per_node: int) -> Placement:
    """Group layout of ``axis``: ranks are numbered x fastest, then y, z, data (grid.py).

    A group stays inside one node iff stride * size <= gpus_per_node. Otherwise it spans
    nodes with gpus_per_node // stride members per node (at least one).
    """
    if axis == "xy":
        size, stride = grid.x * grid.y, 1
    else:
        size, stride = grid.size(axis), grid.stride(axis)
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


def gemm_seconds(flops: float, hw: Hardware, cal: Calibration) -> float:
    """Time of one GEMM call of ``flops`` on one GPU."""
    if flops <= 0:
        return 0.0
    measured = cal.gemm_tflops(flops)
    if measured is not None:
        return flops / (measured * 1e12)
    peak = hw.peak_tflops_per_gpu if hw.peak_tflops_per_gpu > 0 else NOMINAL_CPU_TFLOPS
    return flops / (peak * cal.gemm_efficiency * 1e12) + cal.kernel_overhead_us * 1e-6


# Element passes (one read or one write of an element) per token of the element-wise
# kernels of one transformer layer's forward, as the training core runs them. A fused
# LayerNorm reads and writes once (2); the x-exact LayerNorm of x > 1 squares, sums twice,
# subtracts, scales, multiplies by the weight and adds the bias (12). A residual add reads
# two and writes one (3). GeLU reads and writes (2). Q, K, V and the attention output are
# copied between layouts (2 each). The attention core is fused (flash attention).
LN_FUSED_PASSES, LN_EXACT_PASSES, ADD_PASSES, GELU_PASSES, COPY_PASSES = 2, 12, 3, 2, 2
BACKWARD_FACTOR = 2  # a backward kernel reads the output gradient and the saved input
LOSS_PASSES = 6  # softmax cross-entropy: max, exp, sum, normalize; its gradient


def elementwise_elements(model: ModelSpec, grid: Grid) -> tuple[float, float]:
    """(per layer forward, head forward + backward) element passes per token.

    The residual stream is split over x (h/x per token), the attention heads and the MLP's
    hidden over y (3h/y, h/y, f/y), the vocabulary over the x*y plane.
    """
    h, f = model.d_model, model.d_ff
    ln = LN_FUSED_PASSES if grid.x == 1 else LN_EXACT_PASSES
    per_layer = (2 * ln + 2 * ADD_PASSES) * h / grid.x
    per_layer += COPY_PASSES * 4 * h / grid.y + GELU_PASSES * f / grid.y
    head = LOSS_PASSES * model.vocab_size / (grid.x * grid.y)
    return per_layer, head


@dataclass(frozen=True)
class LinearShape:
    """One Linear of a GPT block and the axes its all-reduces use (axonn.md §2.4).

    ``inner`` splits the input features and carries the forward all-reduce of the
    output; ``outer`` splits the output features and carries the backward all-reduce of
    dX. transpose=True swaps x and y.
    """

    name: str
    fan_in: int
    fan_out: int
    inner: str  # axis splitting fan_in
    outer: str  # axis splitting fan_out


def block_linears(model: ModelSpec) -> tuple[LinearShape, ...]:
    h, f = model.d_model, model.d_ff
    return (
        LinearShape("qkv", h, 3 * h, inner="x", outer="y"),
        LinearShape("proj", h, h, inner="y", outer="x"),  # transpose=True
        LinearShape("fc1", h, f, inner="x", outer="y"),
        LinearShape("fc2", f, h, inner="y", outer="x"),  # transpose=True (§4.3 corrected)
    )


# --------------------------------------------------------------------------- precision


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of traffic, as the training core sends it.

    Under bf16 autocast the Linear outputs are bf16, so the forward all-reduces are too.
    A backward dX all-reduce has the dtype of the Linear's input, which is fp32 for
    QKV, MLP-up and MLP-down (LayerNorm and GeLU outputs on the fp32 residual path):
    counted as fp32 for all four. Weights and their gradients are fp32 (master weights
    are gathered as stored; AxoNN's Gordon Bell branch casts them to bf16 first).
    """

    act_fwd: int = 2
    act_bwd: int = 4
    weight: int = 4
    grad: int = 4

    @classmethod
    def for_run(cls, train: TrainConfig, hardware: Hardware) -> Precision:
        cpu = hardware.gpu_model == "cpu" or hardware.peak_tflops_per_gpu <= 0
        if train.dtype == "fp32" or (train.dtype == "auto" and cpu):
            return cls(act_fwd=4, act_bwd=4, weight=4, grad=4)
        return cls()


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


def pipelined_exposed(chunk_comm: float, chunk_compute: float, n: int) -> float:
    """Exposed time of n collectives, each overlapping the compute chunk that follows it.

    The collectives run one after another on their own stream; collective i may start
    once compute chunk i starts (a prefetch one module ahead, or a reduce-scatter issued
    when its gradient is ready). With equal chunks c (communication) and b (compute) the
    last collective ends max(n*b + c, b + n*c) - n*b after the compute, i.e.
    c + (n-1) * max(0, c - b): one chunk is always exposed, the others only by what
    exceeds the compute they hide behind.
    """
    if n <= 0 or chunk_comm <= 0:
        return 0.0
    return chunk_comm + (n - 1) * max(0.0, chunk_comm - chunk_compute)


class _Costs:
    """Collective and GEMM times for one grid, with bandwidths looked up once per axis."""

    def __init__(self, hw: Hardware, grid: Grid, cal: Calibration) -> None:
        self.hw, self.grid, self.cal = hw, grid, cal
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

    def gemm(self, flops: float) -> float:
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
    cal = calibration or Calibration()
    costs = _Costs(hardware, grid, cal)
    prec = Precision.for_run(train, hardware)
    compute, micro = _micro_step(costs, model, train, grid, prec)
    accum = max(1, train.accumulation_steps(grid))
    ledger = micro.scaled(accum)
    ledger.merge(_gradient_sync(costs, model, grid, prec))
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


def _micro_step(
    costs: _Costs, model: ModelSpec, train: TrainConfig, grid: Grid, prec: Precision
) -> tuple[float, _Ledger]:
    """Compute seconds and communication ledger of one micro-step (forward + backward)."""
    s, h, layers = train.seq_len, model.d_model, model.n_layer
    tokens = train.micro_batch / grid.z * s  # T
    ov = train.overlap
    linears = block_linears(model)
    xy = grid.x * grid.y
    passes = 2 if train.activation_checkpointing else 1  # forward (+ recompute forward)

    # Compute, per layer. Each Linear's forward GEMM is 2*T*in*out/(x*y) FLOPs (its local
    # block, axonn.md §2.3); dX and dW GEMMs cost as much each. The attention core has its
    # heads split over y and is repeated on every x rank: QK^T and AV are 2 * 2*T*s*h/y
    # FLOPs forward (the s/(6h) term of Narayanan's formula), twice that backward.
    fwd_gemm = [costs.gemm(2 * tokens * lin.fan_in * lin.fan_out / xy) for lin in linears]
    attn = costs.gemm(4 * tokens * s * h / grid.y)
    per_layer, head_passes = elementwise_elements(model, grid)
    kernel = 3 * tokens * h / grid.x * prec.act_fwd  # a residual add
    fwd_ew = costs.memory(tokens * per_layer * prec.act_fwd, kernel)
    fwd_compute = sum(fwd_gemm) + attn + fwd_ew
    bwd_compute = 2 * sum(fwd_gemm) + 2 * attn + BACKWARD_FACTOR * fwd_ew

    # Forward all-reduces (blocking, §3.1): each Linear's output, T*fan_out/outer elements,
    # over its inner axis: 7Th/y over x and 2Th/x over y per layer (§2.7, §4.3 corrected).
    # The two LayerNorms all-reduce (sum, sum of squares) over x: 2T fp32 each, forward
    # and backward.
    fwd_ar = dict.fromkeys(("x", "y"), 0.0)
    for lin in linears:
        elems = tokens * lin.fan_out / grid.size(lin.outer)
        fwd_ar[lin.inner] += costs.coll(ALL_REDUCE, lin.inner, elems * prec.act_fwd)
    norm_ar = 2 * costs.coll(ALL_REDUCE, "x", 2 * tokens * 4)
    fwd_ar["x"] += norm_ar

    # Backward dX all-reduces over the outer axis, T*fan_in/inner elements: 5Th/y over x and
    # 2Th/x over y per layer. OAR hides each behind its Linear's dW GEMM.
    bwd_raw = dict.fromkeys(("x", "y"), 0.0)
    bwd_exposed = dict.fromkeys(("x", "y"), 0.0)
    for lin, gemm in zip(linears, fwd_gemm, strict=True):
        elems = tokens * lin.fan_in / grid.size(lin.inner)
        t = costs.coll(ALL_REDUCE, lin.outer, elems * prec.act_bwd)
        bwd_raw[lin.outer] += t
        hidden_ok = partly_hidden(t, max(0.0, t - gemm), costs.cal.overlap_efficiency)
        bwd_exposed[lin.outer] += hidden_ok if ov.all_reduce else t
    bwd_raw["x"] += norm_ar
    bwd_exposed["x"] += norm_ar

    ledger = _Ledger()
    for axis in ("x", "y"):
        raw = layers * (passes * fwd_ar[axis] + bwd_raw[axis])
        ledger.add(axis, raw, layers * (passes * fwd_ar[axis] + bwd_exposed[axis]))
    fwd_busy = fwd_compute + sum(fwd_ar.values())
    bwd_busy = bwd_compute + sum(bwd_exposed.values())
    _weight_traffic(costs, model, linears, ledger, ov, passes, fwd_busy, bwd_busy, prec)
    head = _embedding_and_head(costs, model, grid, tokens, ledger, prec)
    logits = tokens * model.vocab_size / (grid.x * grid.y) * 4  # the loss runs in fp32
    head += costs.memory(tokens * head_passes * 4, 2 * logits)
    compute = layers * (passes * fwd_compute + bwd_compute) + head
    return compute, ledger


def _weight_traffic(costs, model, linears, ledger, ov, passes, fwd_busy, bwd_busy, prec) -> None:
    """All-gathers and reduce-scatters of the Linear weights over z, per micro-step.

    Every Linear gathers its (fan_out/outer) x (fan_in/inner) block in the forward, in
    the recompute forward, and again in the backward (the training core keeps only the z
    shard between passes). OAG prefetches one Linear ahead, so the forward pipelines 4l
    gathers behind the forward Linears, and the backward 4l (or 8l with recompute)
    gathers behind the backward work. The weight-grad reduce-scatter (same bytes) is
    issued after each dW GEMM; with ORS it is waited for only at the next forward, so it
    pipelines behind the rest of the backward.
    """
    layers, n = model.n_layer, len(linears)
    xy = costs.grid.x * costs.grid.y
    block_bytes = [lin.fan_in * lin.fan_out / xy * prec.weight for lin in linears]
    ag = sum(costs.coll(ALL_GATHER, "z", b) for b in block_bytes) / n  # per Linear
    rs = sum(costs.coll(REDUCE_SCATTER, "z", b) for b in block_bytes) / n
    gathers_fwd, gathers_bwd = n * layers, n * layers * passes
    bwd_phase = bwd_busy + (passes - 1) * fwd_busy  # backward + recompute, per layer
    e = costs.cal.overlap_efficiency
    ag_fwd, ag_bwd = ag * gathers_fwd, ag * gathers_bwd
    if ov.all_gather:
        ag_fwd = partly_hidden(ag_fwd, pipelined_exposed(ag, fwd_busy / n, gathers_fwd), e)
        perfect = pipelined_exposed(ag, bwd_phase * layers / gathers_bwd, gathers_bwd)
        ag_bwd = partly_hidden(ag_bwd, perfect, e)
    ledger.add("z", ag * (gathers_fwd + gathers_bwd), ag_fwd + ag_bwd)
    rs_raw = rs * n * layers
    rs_exposed = rs_raw
    if ov.reduce_scatter:
        rs_exposed = partly_hidden(rs_raw, pipelined_exposed(rs, bwd_phase / n, n * layers), e)
    ledger.add("z", rs_raw, rs_exposed)


def _embedding_and_head(costs, model, grid, tokens, ledger, prec) -> float:
    """Vocab-parallel token table over the x*y plane (axonn.md §2.5, the training core's
    layout); returns its compute seconds and books its traffic.

    z: the table block V/(x*y)*h is all-gathered in the forward and its gradient
    reduce-scattered in the backward (not overlapped). Plane: the embedding sum (T*h,
    fp32) in the forward, the LM head's dX (T*h, fp32) in the backward, the loss's max
    (T) and sums (2T). x: the hidden states gathered for the LM head (T*h) in the
    forward, their gradient gathered in the backward. LM head GEMMs: 2*T*h*V/(x*y) FLOPs
    each for the forward, dX and dW.
    """
    h = model.d_model
    rows = local_vocab(model.vocab_size, grid)
    table = rows * h * prec.weight
    ledger.add("z", costs.coll(ALL_GATHER, "z", table) + costs.coll(REDUCE_SCATTER, "z", table))
    plane = 2 * costs.coll(ALL_REDUCE, "xy", tokens * h * 4)
    plane += costs.coll(ALL_REDUCE, "xy", tokens * 4) + costs.coll(ALL_REDUCE, "xy", 2 * tokens * 4)
    ledger.add("xy", plane)
    ledger.add("x", 2 * costs.coll(ALL_GATHER, "x", tokens * h * 4))
    return 3 * costs.gemm(2 * tokens * h * rows)


def _gradient_sync(costs: _Costs, model: ModelSpec, grid: Grid, prec: Precision) -> _Ledger:
    """Once per step, not overlapped (``finish_gradients``; Megatron-AxoNN likewise refuses
    --overlap-grad-reduce, axonn.md §2.6): one coalesced all-reduce over z of the
    gradients replicated over z (biases, norms, positions), then one over data of every
    local gradient, fp32."""
    ledger = _Ledger()
    replicated = replicated_over_z_elements(model, grid) * prec.grad
    ledger.add("z", costs.coll(ALL_REDUCE, "z", replicated))
    ledger.add(
        "data", costs.coll(ALL_REDUCE, "data", local_param_elements(model, grid) * prec.grad)
    )
    return ledger


def comm_volumes_per_layer(model: ModelSpec, train: TrainConfig, grid: Grid) -> dict[str, float]:
    """Elements moved per transformer layer per micro-step, by collective and axis.

    The table of axonn.md §2.7 with the §4.3 correction, written out for checking (the
    LayerNorm statistics are left out): keys ``fwd_ar_x``, ``fwd_ar_y``, ``bwd_ar_x``,
    ``bwd_ar_y``, ``ag_z``, ``rs_z``. Forward entries include the recompute pass when
    activation checkpointing is on; ``ag_z`` includes the backward re-gather.
    """
    tokens = train.micro_batch / grid.z * train.seq_len
    passes = 2 if train.activation_checkpointing else 1
    out = dict.fromkeys(("fwd_ar_x", "fwd_ar_y", "bwd_ar_x", "bwd_ar_y", "ag_z", "rs_z"), 0.0)
    for lin in block_linears(model):
        out[f"fwd_ar_{lin.inner}"] += passes * tokens * lin.fan_out / grid.size(lin.outer)
        out[f"bwd_ar_{lin.outer}"] += tokens * lin.fan_in / grid.size(lin.inner)
        block = lin.fan_in * lin.fan_out / (grid.x * grid.y)
        out["ag_z"] += (passes + 1) * block
        out["rs_z"] += block
    return out
