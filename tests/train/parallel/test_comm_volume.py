"""Collectives issued by the parallel GPT (and Llama's KV replica sum), counted, sized
and typed (4 gloo ranks).

The expected records are derived from the layer definitions (which group each Linear
reduces over, how big its local output, input and weight block are, and which dtype
each collective travels in), compared as a multiset with what ``Comm`` recorded in
forward, backward and ``finish_gradients``. The per-layer sums are then checked, in
bytes (elements times the recorded dtype's size), against the AxoNN volume table
transcribed from axonn.md section 2.7: forward all-reduce over x 7Th/G_y and over y
2Th/G_x (in the activations' dtype, repeated by the recompute of activation
checkpointing), backward dX all-reduce over y 2Th/G_x and over x 5Th/G_y (wire
all-reduce dtype), and 12h^2/(G_x G_y) gathered elements per weight all-gather (wire
all-gather dtype; forward and backward re-gather, or with recompute forward and the
recompute's gather that its backward reuses; a cached block gathers once) and per
weight-grad reduce-scatter (wire
reduce-scatter dtype). Collectives over groups of one rank must not be issued at all.

The ORS window test checks that at most 4K weight-grad reduce-scatters (K blocks of 4
Linears) are ever pending and that the gradients are bit-identical to no bound.
"""

from __future__ import annotations

from collections import Counter

import torch

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.common.traffic import replicated_kv_elements
from axonn_launch.train.models.gpt import GPT, finish_gradients, full_grad_dict
from axonn_launch.train.models.registry import build_model
from axonn_launch.train.parallel.comm import FP32_WIRE, Wire
from axonn_launch.train.parallel.groups import build_groups
from tests.train.dist_utils import run_world

SPEC = ModelSpec("tiny", n_layer=2, d_model=32, n_head=4, vocab_size=61, max_seq_len=16)
MICRO_BATCH, SEQ = 8, 16
GRIDS = [Grid(x=2, y=2), Grid(x=2, z=2), Grid(y=2, z=2), Grid(z=4), Grid(x=4), Grid(data=2, y=2)]
OVERLAPS = [OverlapConfig(False, False, False), OverlapConfig(True, True, True)]
BF16_WIRE = Wire(all_gather=torch.bfloat16, reduce_scatter=torch.bfloat16,
                 all_reduce=torch.bfloat16)  # fmt: skip
FP32 = torch.float32  # activations (the runs compute in fp32), statistics, losses


def _linears(spec: ModelSpec, layer: int):
    """(tag, in, out, transpose) of one block's Linears, as the model builds them."""
    h, f, name = spec.d_model, spec.d_ff, f"blocks.{layer}"
    return [
        (f"{name}.attn.qkv", h, 3 * h, False),
        (f"{name}.attn.proj", h, h, True),
        (f"{name}.mlp.up", h, f, False),
        (f"{name}.mlp.down", f, h, True),
    ]


class Expected:
    """The records one micro-step should produce, keyed (op, axis, tag, numel, dtype)."""

    def __init__(self, grid: Grid, spec: ModelSpec, tokens: int, wire: Wire = FP32_WIRE) -> None:
        self.grid, self.spec, self.t, self.wire = grid, spec, tokens, wire
        self.records: Counter = Counter()

    def add(self, op: str, axis: str, tag: str, numel: int, dtype: torch.dtype) -> None:
        size = self.grid.x * self.grid.y if axis == "plane" else self.grid.size(axis)
        if size > 1:
            self.records[(op, axis, tag, numel, dtype)] += 1

    def linear_forward(self, tag, d_in, d_out, transpose, gather: bool = True) -> None:
        inner, outer = ("y", "x") if transpose else ("x", "y")
        g = self.grid
        if gather:
            self.add("all_gather", "z", tag, d_out * d_in // (g.x * g.y), self.wire.all_gather)
        self.add("all_reduce", inner, tag, self.t * d_out // g.size(outer), FP32)

    def linear_backward(self, tag, d_in, d_out, transpose, gather: bool = True) -> None:
        inner, outer = ("y", "x") if transpose else ("x", "y")
        g, block = self.grid, d_out * d_in // (self.grid.x * self.grid.y)
        if gather:
            self.add("all_gather", "z", tag, block, self.wire.all_gather)
        self.add("all_reduce", outer, tag, self.t * d_in // g.size(inner), self.wire.all_reduce)
        self.add("reduce_scatter", "z", tag, block, self.wire.reduce_scatter)

    def norm_forward(self, tag: str) -> None:
        # per token and x member: shift, mean correction and M2, gathered over x
        self.add("all_gather", "x", tag, 3 * self.t * self.grid.x, FP32)

    def norm_backward(self, tag: str) -> None:
        self.add("all_reduce", "x", tag, 2 * self.t, FP32)  # sum g, sum g * x_hat

    def block_forward(self, layer: int, gather: bool = True) -> None:
        for norm in ("ln1", "ln2"):
            self.norm_forward(f"blocks.{layer}.{norm}")
        for linear in _linears(self.spec, layer):
            self.linear_forward(*linear, gather=gather)

    def block_backward(self, layer: int, gather: bool = True) -> None:
        for norm in ("ln1", "ln2"):
            self.norm_backward(f"blocks.{layer}.{norm}")
        for linear in _linears(self.spec, layer):
            self.linear_backward(*linear, gather=gather)

    def embedding_and_loss_forward(self, padded_vocab: int) -> None:
        h, plane = self.spec.d_model, self.grid.x * self.grid.y
        self.add("all_gather", "z", "wte", padded_vocab // plane * h, self.wire.all_gather)
        self.add("all_reduce", "plane", "embedding", self.t * h, FP32)
        self.norm_forward("ln_f")
        self.add("all_gather", "x", "lm_head", self.t * h, FP32)
        self.add("all_reduce_max", "plane", "cross_entropy", self.t, FP32)
        self.add("all_reduce", "plane", "cross_entropy", 2 * self.t, FP32)

    def embedding_and_loss_backward(self, padded_vocab: int) -> None:
        h, plane = self.spec.d_model, self.grid.x * self.grid.y
        self.add("all_reduce", "plane", "lm_head", self.t * h, FP32)
        self.norm_backward("ln_f")
        self.add("all_gather", "x", "embedding", self.t * h, FP32)
        self.add("reduce_scatter", "z", "wte", padded_vocab // plane * h, self.wire.reduce_scatter)


def _as_counter(records) -> Counter:
    return Counter((r.op, r.axis, r.tag, r.numel, r.dtype) for r in records)


def _assert_table_bytes(rec_fwd, rec_bwd, grid, spec, tokens, recompute, wire, cached, label):
    """Per-layer bytes against the formulas of axonn.md section 2.7 (elements times e,
    the bytes per element of the dtype each collective travels in). With full recompute
    the backward pass also repeats the forward all-reduces and, unless the block is
    cached, the weight all-gather; a cached block gathers its weights once."""
    t, h = tokens, spec.d_model
    e_act, e_ag, e_rs, e_ar = (dtype.itemsize for dtype in (
        FP32, wire.all_gather, wire.reduce_scatter, wire.all_reduce))  # fmt: skip
    for layer in range(spec.n_layer):
        linear_tags = [tag for tag, *_ in _linears(spec, layer)]

        def total(records: Counter, op: str, axis: str, tags=tuple(linear_tags)) -> int:
            return sum(n * dtype.itemsize * count for (o, a, tag, n, dtype), count
                       in records.items() if o == op and a == axis and tag in tags)  # fmt: skip

        def on(axis, value):
            return value if grid.size(axis) > 1 else 0

        fwd_x, fwd_y = on("x", 7 * t * h // grid.y * e_act), on("y", 2 * t * h // grid.x * e_act)
        block = on("z", 12 * h * h // (grid.x * grid.y))
        again = 1 if recompute else 0
        # an uncached block gathers once more in the backward: the re-gather, or with
        # recompute the recomputed forward's gather, which its backward then reuses
        gathers_in_backward = 0 if layer < cached else 1
        assert total(rec_fwd, "all_reduce", "x") == fwd_x, label
        assert total(rec_fwd, "all_reduce", "y") == fwd_y, label
        bwd_y = on("y", 2 * t * h // grid.x * e_ar) + again * fwd_y
        bwd_x = on("x", 5 * t * h // grid.y * e_ar) + again * fwd_x
        assert total(rec_bwd, "all_reduce", "y") == bwd_y, label
        assert total(rec_bwd, "all_reduce", "x") == bwd_x, label
        assert total(rec_fwd, "all_gather", "z") == block * e_ag, label
        assert total(rec_bwd, "all_gather", "z") == gathers_in_backward * block * e_ag, label
        assert total(rec_bwd, "reduce_scatter", "z") == block * e_rs, label


def _expected_grad_sync(model: GPT, grid: Grid) -> Counter:
    expected = Counter()
    params = list(model.parameters())
    if grid.z > 1:
        over_z = sum(p.numel() for p in params if "z" in p.shard_layout.replicated_over)
        expected[("all_reduce", "z", "grad_sync", over_z, FP32)] += 1
    if grid.data > 1:
        expected[("all_reduce", "data", "grad_sync", sum(p.numel() for p in params), FP32)] += 1
    return expected


def _check_volumes(rank: int, world: int) -> int:
    checked = 0
    for grid in GRIDS:
        groups = build_groups(grid, rank=rank)
        tokens = MICRO_BATCH // (grid.data * grid.z) * SEQ
        for overlap in OVERLAPS:
            for checkpointing in (False, True):
                label = f"[{grid.describe()} {overlap} ckpt={checkpointing}]"
                _check_one(groups, grid, overlap, checkpointing, tokens, label)
                checked += 1
    return checked


def _check_one(groups, grid, overlap, checkpointing, tokens, label, wire=FP32_WIRE,
               cache_layers=0) -> None:  # fmt: skip
    model = GPT(SPEC, groups=groups, overlap=overlap, activation_checkpointing=checkpointing,
                wire=wire, cache_layers=cache_layers)  # fmt: skip
    b_local = MICRO_BATCH // (grid.data * grid.z)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, SPEC.vocab_size, (b_local, SEQ), generator=gen)
    with model.comm.recording() as rec_fwd:
        loss = model(idx, idx)
    with model.comm.recording() as rec_bwd:
        loss.backward()
    assert model.runtime.cached_bytes == 0, f"{label} cached weights outlive their backward"
    with model.comm.recording() as rec_sync:
        finish_gradients(model, groups)

    padded = model.embedding.padded_vocab
    fwd, bwd = Expected(grid, SPEC, tokens, wire), Expected(grid, SPEC, tokens, wire)
    fwd.embedding_and_loss_forward(padded)
    for layer in range(SPEC.n_layer):
        fwd.block_forward(layer)
    for layer in reversed(range(SPEC.n_layer)):
        uncached = layer >= cache_layers
        if checkpointing:
            bwd.block_forward(layer, gather=uncached)  # the recomputed forward
        bwd.block_backward(layer, gather=uncached and not checkpointing)  # else: reuses it
    bwd.embedding_and_loss_backward(padded)
    got_fwd, got_bwd = _as_counter(rec_fwd.records), _as_counter(rec_bwd.records)
    first = _first_backward_gather(grid, checkpointing, cache_layers, wire)
    if overlap.all_gather and first is not None:
        # the forward already prefetches the weight that the backward gathers first
        assert got_fwd - fwd.records == Counter([first]), f"{label} {got_fwd - fwd.records}"
        got_fwd[first] -= 1
        got_bwd[first] += 1
    assert got_fwd == fwd.records, f"{label} forward collectives {_diff(got_fwd, fwd.records)}"
    assert got_bwd == bwd.records, f"{label} backward collectives {_diff(got_bwd, bwd.records)}"
    assert _as_counter(rec_sync.records) == _expected_grad_sync(model, grid), f"{label} sync"
    _assert_table_bytes(got_fwd, got_bwd, grid, SPEC, tokens, checkpointing, wire,
                        cache_layers, label)  # fmt: skip
    assert all(r.group_size > 1 for r in rec_fwd.records + rec_bwd.records), label


def _first_backward_gather(grid: Grid, checkpointing: bool, cache_layers: int, wire: Wire):
    """The record of the backward's first weight all-gather (None: there is none): the
    last uncached block's QKV with recompute (its forward runs again first), else its
    MLP-down."""
    uncached = [layer for layer in range(SPEC.n_layer) if layer >= cache_layers]
    if grid.z == 1 or not uncached:
        return None
    block = _linears(SPEC, uncached[-1])
    tag, d_in, d_out, _ = block[0] if checkpointing else block[-1]
    return ("all_gather", "z", tag, d_in * d_out // (grid.x * grid.y), wire.all_gather)


def test_collectives_match_the_layer_definitions_and_the_volume_table():
    results = run_world(_check_volumes, 4, timeout=600)
    assert results == [len(GRIDS) * len(OVERLAPS) * 2] * 4


def _diff(got: Counter, want: Counter) -> str:
    return f"unexpected {dict(got - want)}, missing {dict(want - got)}"


# ---------------------------------------------------------------------------------------
# Wire dtypes and weight caching

WIRE_GRIDS = [Grid(x=2, z=2), Grid(y=2, z=2), Grid(x=2, y=2)]
WIRES = {"fp32": FP32_WIRE, "bf16": BF16_WIRE}


def _check_wires_and_caching(rank: int, world: int) -> int:
    checked = 0
    for grid in WIRE_GRIDS:
        groups = build_groups(grid, rank=rank)
        tokens = MICRO_BATCH // (grid.data * grid.z) * SEQ
        for wire_name, wire in WIRES.items():
            for cache_layers in range(SPEC.n_layer + 1):
                for overlap in OVERLAPS:
                    for checkpointing in (False, True):
                        label = (f"[{grid.describe()} wire={wire_name} cache={cache_layers} "
                                 f"{overlap} ckpt={checkpointing}]")  # fmt: skip
                        _check_one(groups, grid, overlap, checkpointing, tokens, label, wire,
                                   cache_layers)  # fmt: skip
                        checked += 1
    return checked


def test_bytes_per_layer_with_wire_dtypes_and_weight_caching():
    results = run_world(_check_wires_and_caching, 4, timeout=600)
    assert results == [len(WIRE_GRIDS) * len(WIRES) * (SPEC.n_layer + 1) * len(OVERLAPS) * 2] * 4


# ---------------------------------------------------------------------------------------
# ORS window

SPEC_3 = ModelSpec("tiny3", n_layer=3, d_model=32, n_head=4, vocab_size=61, max_seq_len=16)
WINDOW_GRIDS = [Grid(z=4), Grid(x=2, z=2)]


def _window_run(groups, grid: Grid, window: int, checkpointing: bool):
    """Two micro-steps; returns (most reduce-scatters ever pending, full gradients)."""
    model = GPT(SPEC_3, groups=groups, overlap=OverlapConfig(), ors_window=window,
                activation_checkpointing=checkpointing, cache_layers=1, seed=3)  # fmt: skip
    b_local = MICRO_BATCH // (grid.data * grid.z)
    for micro in range(2):
        gen = torch.Generator().manual_seed(10 + micro)
        idx = torch.randint(0, SPEC_3.vocab_size, (b_local, SEQ), generator=gen)
        model(idx, idx).backward()
    finish_gradients(model, groups)
    return model.runtime.peak_pending, full_grad_dict(model, groups)


def _check_windows(rank: int, world: int) -> int:
    linears = 4 * SPEC_3.n_layer  # weight-grad reduce-scatters per micro-step
    checked = 0
    for grid in WINDOW_GRIDS:
        groups = build_groups(grid, rank=rank)
        for checkpointing in (False, True):
            label = f"[{grid.describe()} ckpt={checkpointing}]"
            peak, unbounded = _window_run(groups, grid, 0, checkpointing)
            assert peak == linears, f"{label} no bound: every reduce-scatter pends"
            for window in (1, 2):
                peak, grads = _window_run(groups, grid, window, checkpointing)
                assert peak == 4 * window, f"{label} K={window}: {peak} pending at most"
                for name, grad in unbounded.items():
                    assert torch.equal(grads[name], grad), f"{label} K={window} grad of {name}"
                checked += 1
    return checked


def test_ors_window_bounds_pending_reduce_scatters_and_keeps_gradients():
    assert run_world(_check_windows, 4, timeout=600) == [len(WINDOW_GRIDS) * 2 * 2] * 4


# ------------------------------------------------------------ Llama's KV replicas

LLAMA = ModelSpec("tiny-llama", n_layer=2, d_model=32, n_head=4, vocab_size=61, max_seq_len=16,
                  arch="llama", n_kv_head=1, ffn_hidden=64)  # fmt: skip
REPLICA_GRIDS = [Grid(y=4), Grid(y=2, z=2), Grid(x=2, y=2), Grid(x=2, z=2)]


def _replica_records(rank: int, world: int) -> list[list[tuple]]:
    """The gradient sync's records over the KV replicas, per grid."""
    out = []
    for grid in REPLICA_GRIDS:
        groups = build_groups(grid, rank=rank)
        model = build_model(LLAMA, groups=groups, overlap=OverlapConfig(), seed=1)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        with model.comm.recording() as rec:
            finish_gradients(model, groups, average=False)
        out.append([(r.op, r.group_size, r.numel, r.dtype, r.tag)
                    for r in rec.select(axis="y_replicas")])  # fmt: skip
    return out


def test_the_kv_replica_gradient_sum_is_recorded_as_the_traffic_model_prices_it():
    """One KV head over y=2 or 4 ranks: its gradient is summed over the y replicas once per
    step, recorded, and exactly the size ``traffic.replicated_kv_elements`` prices (per
    block, split over z); grids without replicas issue none."""
    for records in run_world(_replica_records, 4):
        for grid, got in zip(REPLICA_GRIDS, records, strict=True):
            if grid.y == 1:
                assert got == [], grid.describe()
                continue
            elements = LLAMA.n_layer * replicated_kv_elements(LLAMA, grid) / grid.z
            assert got == [("all_reduce", grid.y, elements, FP32, "grad_sync")], grid.describe()
