"""What one transformer block sends per micro-step: every collective, its axis, its
size and the bytes per element on the wire. One function (``block_collectives``) that
the step-time model (``perf.py``) prices and the memory model (``memory.py``) reads the
wire dtypes from. Torch-free: the planner runs on login nodes.

The block is AxoNN's (axonn.md §2.3-§2.7) as the training core runs it. GPT: four Linears
(QKV, attention projection, MLP up, MLP down; the second and fourth transposed, so x and
y swap roles) and two LayerNorms whose statistics travel over x when x > 1. Llama: five
Linears without biases (query, key-value, attention projection, SwiGLU gate-up, down;
the third and fifth transposed) and two RMSNorms; with more y ranks than KV heads each
y rank holds the one KV head its query heads use (``LinearShape.out_groups``), and that
block's weight gradient is all-reduced over its y / n_kv_head replicas once per optimizer
step (``replicated_kv_elements``, priced with the other per-step gradient collectives in
perf.py). With T = tokens per GPU per micro-step = micro_batch / z * seq_len, per Linear with input
features split over ``inner`` and output features over ``outer``:

* forward: all-gather of the weight block (fan_out/outer x fan_in/inner) over z, then
  the all-reduce of the output, T*fan_out/outer elements (a replicated KV block:
  T*2*head_dim), over ``inner``;
* recompute forward (activation checkpointing): the same again, and the gathered
  block is kept for the backward that follows it;
* backward: the weight block all-gathered again unless the recompute kept it (without
  recompute the core keeps only the z shard between passes), the all-reduce of dX,
  T*fan_in/inner elements, over ``outer``, and the reduce-scatter of the weight-gradient
  block over z. So three z collectives per Linear, with or without recompute, as in
  AxoNN's volume (axonn.md §4.1).

A cached block (``train.cache_layers``: the first N blocks) keeps its forward gathers:
no recompute gather and no backward re-gather. Collectives over an axis of size 1 send
nothing and are left out, as the core skips them.

Wire dtypes (``train.wire``; ``auto`` = bf16 when the compute is bf16, i.e.
``train.dtype`` bf16, or auto on a GPU; fp32 otherwise): z weight all-gathers in
``wire.all_gather``, z weight-gradient reduce-scatters in ``wire.reduce_scatter``, dX
all-reduces over x and y in ``wire.all_reduce``. Forward output all-reduces travel in
the compute dtype (autocast's bf16 GEMM outputs), norm statistics in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import TrainConfig

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)

FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"
BF16, FP32 = 2, 4
NORM = "norm"  # the ``linear`` of the LayerNorm statistics


# --------------------------------------------------------------------------- dtypes


@dataclass(frozen=True)
class WireBytes:
    """Bytes per element of each kind of traffic."""

    compute: int  # autocast GEMM outputs: forward all-reduces, activations
    all_gather: int  # z weight all-gathers (Linears and token table)
    reduce_scatter: int  # z weight-gradient reduce-scatters
    all_reduce: int  # dX all-reduces over x and y
    grad: int = FP32  # gradient all-reduces over z and data, fp32 whatever the wire


def wire_bytes(train: TrainConfig, *, on_gpu: bool) -> WireBytes:
    """The bytes per element the run sends, resolving ``auto`` (module docstring)."""
    bf16 = train.computes_in_bf16(on_gpu)
    named = {"bf16": BF16, "fp32": FP32}
    wire = train.wire.resolved(bf16)
    compute = BF16 if bf16 else FP32
    return WireBytes(
        compute=compute,
        all_gather=named[wire.all_gather],
        reduce_scatter=named[wire.reduce_scatter],
        all_reduce=named[wire.all_reduce],
    )


# --------------------------------------------------------------------------- the block


@dataclass(frozen=True)
class LinearShape:
    """One Linear of a block and the axes its all-reduces use (axonn.md §2.4).

    ``inner`` splits the input features and carries the forward all-reduce of the
    output; ``outer`` splits the output features and carries the backward all-reduce of
    dX. transpose=True swaps x and y. ``out_groups`` > 0: the output features come in
    that many groups that are never split (Llama's KV heads), so with more ``outer``
    ranks than groups each rank holds one whole group, replicated over
    outer / out_groups ranks. ``segments``: runs of rows stored one after another (q, k
    and v of the fused QKV), for the checkpoint's layout (jobcost.py).
    """

    name: str
    fan_in: int
    fan_out: int
    inner: str  # axis splitting fan_in
    outer: str  # axis splitting fan_out
    out_groups: int = 0
    segments: int = 1

    def out_split(self, grid: Grid) -> int:
        """Distinct shares of the output features along ``outer``."""
        size = grid.size(self.outer)
        return min(size, self.out_groups) if self.out_groups else size

    def replicas(self, grid: Grid) -> int:
        """Ranks along ``outer`` holding the same weight block (1: none replicated)."""
        return grid.size(self.outer) // self.out_split(grid)

    def rows(self, grid: Grid) -> float:
        """Output features of this rank's weight block."""
        return self.fan_out / self.out_split(grid)

    def cols(self, grid: Grid) -> float:
        """Input features of this rank's weight block."""
        return self.fan_in / grid.size(self.inner)

    def block_elements(self, grid: Grid) -> float:
        """Elements of this rank's weight block before the split over z."""
        return self.fan_in * self.fan_out / (grid.size(self.inner) * self.out_split(grid))


def block_linears(model: ModelSpec) -> tuple[LinearShape, ...]:
    """The Linears of one block in forward order, as the training core builds them."""
    h, f = model.d_model, model.d_ff
    if model.is_llama:
        kv = 2 * model.kv_dim  # k rows then v rows, never splitting a KV head
        return (
            LinearShape("q", h, h, inner="x", outer="y"),
            LinearShape("kv", h, kv, inner="x", outer="y", out_groups=model.kv_heads, segments=2),
            LinearShape("proj", h, h, inner="y", outer="x"),  # transposed
            LinearShape("gate_up", h, 2 * f, inner="x", outer="y", segments=2),
            LinearShape("down", f, h, inner="y", outer="x"),  # transposed
        )
    return (
        LinearShape("qkv", h, 3 * h, inner="x", outer="y", segments=3),
        LinearShape("proj", h, h, inner="y", outer="x"),  # transpose=True
        LinearShape("fc1", h, f, inner="x", outer="y"),
        LinearShape("fc2", f, h, inner="y", outer="x"),  # transpose=True (§4.3 corrected)
    )


def linear_weight_elements(model: ModelSpec, grid: Grid) -> float:
    """Elements of one block's Linear weight blocks on one rank, before the split over z."""
    return sum(lin.block_elements(grid) for lin in block_linears(model))


def largest_linear_block(model: ModelSpec, grid: Grid) -> float:
    """Elements of the largest Linear weight block of a rank, before the split over z."""
    return max(lin.block_elements(grid) for lin in block_linears(model))


def replicated_kv_elements(model: ModelSpec, grid: Grid) -> float:
    """Elements of one block's Linear blocks that are replicated over ranks of their
    ``outer`` axis (Llama's KV heads when y > n_kv_head), before the split over z.
    Their gradients are all-reduced over each group of replicas once per step."""
    return sum(lin.block_elements(grid) for lin in block_linears(model) if lin.replicas(grid) > 1)


@dataclass(frozen=True)
class Collective:
    """One collective of a block's micro-step; ``elements`` is the full (gathered) size."""

    op: str  # all_reduce | all_gather | reduce_scatter
    axis: str  # x | y | z
    elements: float
    itemsize: int  # bytes per element on the wire
    phase: str  # forward | recompute | backward
    linear: str  # a LinearShape's name (qkv | proj | fc1 | fc2; q | kv | gate_up | down) or norm

    @property
    def nbytes(self) -> float:
        return self.elements * self.itemsize


def tokens_per_gpu(train: TrainConfig, grid: Grid) -> float:
    """T: tokens of one micro-step on one GPU (the micro-batch is split over z)."""
    if train.micro_batch is None:
        raise ValueError("the micro-batch is automatic: resolve it first (rules.py)")
    return train.micro_batch / grid.z * train.seq_len


def is_cached(train: TrainConfig, layer: int) -> bool:
    """Whether block ``layer`` keeps its gathered weights (the first cache_layers)."""
    return layer < (train.cache_layers or 0)


def block_collectives(
    model: ModelSpec, grid: Grid, train: TrainConfig, *, on_gpu: bool, cached: bool = False
) -> tuple[Collective, ...]:
    """Every collective of one block in one micro-step (forward, recompute, backward)."""
    wire = wire_bytes(train, on_gpu=on_gpu)
    tokens = tokens_per_gpu(train, grid)
    forward = _forward_pass(model, grid, tokens, wire, FORWARD, gather=True)
    recompute: tuple[Collective, ...] = ()
    if train.activation_checkpointing:
        recompute = _forward_pass(model, grid, tokens, wire, RECOMPUTE, gather=not cached)
    regather = not cached and not train.activation_checkpointing
    backward = _backward_pass(model, grid, tokens, wire, regather=regather)
    return tuple(c for c in forward + recompute + backward if grid.size(c.axis) > 1)


def _forward_pass(model, grid, tokens, wire: WireBytes, phase: str, *, gather: bool):
    out = list(_norm_statistics(model, tokens, phase, grid.x))
    for lin in block_linears(model):
        if gather:
            out.append(Collective(ALL_GATHER, "z", lin.block_elements(grid), wire.all_gather,
                                  phase, lin.name))  # fmt: skip
        elems = tokens * lin.fan_out / lin.out_split(grid)
        out.append(Collective(ALL_REDUCE, lin.inner, elems, wire.compute, phase, lin.name))
    return tuple(out)


def _backward_pass(model, grid, tokens, wire: WireBytes, *, regather: bool):
    out = list(_norm_statistics(model, tokens, BACKWARD, grid.x))
    for lin in reversed(block_linears(model)):
        block = lin.block_elements(grid)
        if regather:
            out.append(Collective(ALL_GATHER, "z", block, wire.all_gather, BACKWARD, lin.name))
        elems = tokens * lin.fan_in / grid.size(lin.inner)
        out.append(Collective(ALL_REDUCE, lin.outer, elems, wire.all_reduce, BACKWARD, lin.name))
        out.append(Collective(REDUCE_SCATTER, "z", block, wire.reduce_scatter, BACKWARD,
                              lin.name))  # fmt: skip
    return tuple(out)


def _norm_statistics(model: ModelSpec, tokens: float, phase: str, x: int):
    """Each of the block's two norms, fp32 over x.

    LayerNorm (GPT): forward, an all-gather of three numbers per token and rank (shift,
    mean correction, M2: Chan's merge, exact); backward, an all-reduce of two per token
    (sums of g and g * x_hat). RMSNorm (Llama): an all-reduce of one number per token
    each way (the sum of squares forward, the sum of g * x_hat backward).
    """
    if model.is_llama:
        one = Collective(ALL_REDUCE, "x", tokens, FP32, phase, NORM)
    elif phase == BACKWARD:
        one = Collective(ALL_REDUCE, "x", 2 * tokens, FP32, phase, NORM)
    else:
        one = Collective(ALL_GATHER, "x", 3 * tokens * x, FP32, phase, NORM)
    return one, one


def block_volumes(
    model: ModelSpec, grid: Grid, train: TrainConfig, *, on_gpu: bool, cached: bool = False
) -> dict[tuple[str, str, int], float]:
    """Elements per micro-step of one block by (op, axis, bytes per element)."""
    out: dict[tuple[str, str, int], float] = {}
    for c in block_collectives(model, grid, train, on_gpu=on_gpu, cached=cached):
        key = (c.op, c.axis, c.itemsize)
        out[key] = out.get(key, 0.0) + c.elements
    return out
