"""What one transformer block sends per micro-step: every collective, its axis, its
size and the bytes per element on the wire. One function (``block_collectives``) that
the step-time model (``perf.py``) prices and the memory model (``memory.py``) reads the
wire dtypes from. Torch-free: the planner runs on login nodes.

The block is AxoNN's (axonn.md §2.3-§2.7) as the training core runs it: four Linears
(QKV, attention projection, MLP up, MLP down; the second and fourth transposed, so x and
y swap roles), two LayerNorms whose statistics travel over x when x > 1. With
T = tokens per GPU per micro-step = micro_batch / z * seq_len, per Linear with input
features split over ``inner`` and output features over ``outer``:

* forward: all-gather of the weight block (fan_out/outer x fan_in/inner) over z, then
  the all-reduce of the output, T*fan_out/outer elements, over ``inner``;
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
the compute dtype (autocast's bf16 GEMM outputs), LayerNorm statistics in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

from axonn_launch.grid import Grid
from axonn_launch.models import ModelSpec
from axonn_launch.spec import TrainConfig

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

    def block_elements(self, grid: Grid) -> float:
        """Elements of this rank's weight block before the split over z."""
        return self.fan_in * self.fan_out / (grid.x * grid.y)


def block_linears(model: ModelSpec) -> tuple[LinearShape, ...]:
    h, f = model.d_model, model.d_ff
    return (
        LinearShape("qkv", h, 3 * h, inner="x", outer="y"),
        LinearShape("proj", h, h, inner="y", outer="x"),  # transpose=True
        LinearShape("fc1", h, f, inner="x", outer="y"),
        LinearShape("fc2", f, h, inner="y", outer="x"),  # transpose=True (§4.3 corrected)
    )


@dataclass(frozen=True)
class Collective:
    """One collective of a block's micro-step; ``elements`` is the full (gathered) size."""

    op: str  # all_reduce | all_gather | reduce_scatter
    axis: str  # x | y | z
    elements: float
    itemsize: int  # bytes per element on the wire
    phase: str  # forward | recompute | backward
    linear: str  # qkv | proj | fc1 | fc2 | norm

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
    out = list(_norm_statistics(tokens, phase, grid.x))
    for lin in block_linears(model):
        if gather:
            out.append(Collective(ALL_GATHER, "z", lin.block_elements(grid), wire.all_gather,
                                  phase, lin.name))  # fmt: skip
        elems = tokens * lin.fan_out / grid.size(lin.outer)
        out.append(Collective(ALL_REDUCE, lin.inner, elems, wire.compute, phase, lin.name))
    return tuple(out)


def _backward_pass(model, grid, tokens, wire: WireBytes, *, regather: bool):
    out = list(_norm_statistics(tokens, BACKWARD, grid.x))
    for lin in reversed(block_linears(model)):
        block = lin.block_elements(grid)
        if regather:
            out.append(Collective(ALL_GATHER, "z", block, wire.all_gather, BACKWARD, lin.name))
        elems = tokens * lin.fan_in / grid.size(lin.inner)
        out.append(Collective(ALL_REDUCE, lin.outer, elems, wire.all_reduce, BACKWARD, lin.name))
        out.append(Collective(REDUCE_SCATTER, "z", block, wire.reduce_scatter, BACKWARD,
                              lin.name))  # fmt: skip
    return tuple(out)


def _norm_statistics(tokens: float, phase: str, x: int) -> tuple[Collective, Collective]:
    """Each of the block's two LayerNorms, fp32 over x: forward, an all-gather of three
    numbers per token and rank (shift, mean correction, M2: Chan's merge, exact);
    backward, an all-reduce of two per token (sums of g and g * x_hat)."""
    if phase == BACKWARD:
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
