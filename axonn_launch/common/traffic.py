"""What one transformer block sends per micro-step: every collective, its axis, its
size and the bytes per element on the wire. One function (``block_collectives``) that
the step-time model (``perf.py``) prices and the memory model (``memory.py``) reads the
wire dtypes from. Torch-free: the planner runs on login nodes.

The Linears and norm collectives come from the model's architecture (``common/arch/``).
The per-Linear volumes, the cached blocks and the wire dtypes, with their sources:
``docs/cost-model.md`` ("common/traffic.py").
"""

from __future__ import annotations

from dataclasses import dataclass

from axonn_launch.common.arch.base import (
    ALL_GATHER,
    ALL_REDUCE,
    BACKWARD,
    BF16,
    FORWARD,
    FP32,
    RECOMPUTE,
    REDUCE_SCATTER,
    Collective,
    LinearShape,
)
from axonn_launch.common.arch.base import NORM as NORM
from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import TrainConfig

COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)


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


def block_linears(model: ModelSpec) -> tuple[LinearShape, ...]:
    """The Linears of one block in forward order, as the training core builds them."""
    return model.architecture.block_linears(model)


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
    out = list(model.architecture.norm_statistics(tokens, phase, grid.x))
    for lin in block_linears(model):
        if gather:
            out.append(Collective(ALL_GATHER, "z", lin.block_elements(grid), wire.all_gather,
                                  phase, lin.name))  # fmt: skip
        elems = tokens * lin.fan_out / lin.out_split(grid)
        out.append(Collective(ALL_REDUCE, lin.inner, elems, wire.compute, phase, lin.name))
    return tuple(out)


def _backward_pass(model, grid, tokens, wire: WireBytes, *, regather: bool):
    out = list(model.architecture.norm_statistics(tokens, BACKWARD, grid.x))
    for lin in reversed(block_linears(model)):
        block = lin.block_elements(grid)
        if regather:
            out.append(Collective(ALL_GATHER, "z", block, wire.all_gather, BACKWARD, lin.name))
        elems = tokens * lin.fan_in / grid.size(lin.inner)
        out.append(Collective(ALL_REDUCE, lin.outer, elems, wire.all_reduce, BACKWARD, lin.name))
        out.append(Collective(REDUCE_SCATTER, "z", block, wire.reduce_scatter, BACKWARD,
                              lin.name))  # fmt: skip
    return tuple(out)


def block_volumes(
    model: ModelSpec, grid: Grid, train: TrainConfig, *, on_gpu: bool, cached: bool = False
) -> dict[tuple[str, str, int], float]:
    """Elements per micro-step of one block by (op, axis, bytes per element)."""
    out: dict[tuple[str, str, int], float] = {}
    for c in block_collectives(model, grid, train, on_gpu=on_gpu, cached=cached):
        key = (c.op, c.axis, c.itemsize)
        out[key] = out.get(key, 0.0) + c.elements
    return out
