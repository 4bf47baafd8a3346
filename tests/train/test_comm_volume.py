"""Collectives issued by the parallel GPT, counted and sized (4 gloo ranks).

The expected records are derived from the layer definitions (which group each Linear
reduces over and how big its local output, input and weight block are), compared as a
multiset with what ``Comm`` recorded in forward, backward and ``finish_gradients``.
The per-layer sums are then checked against the AxoNN volume table (axonn.md section
2.7): forward all-reduce over x 7Th/G_y and over y 2Th/G_x, backward all-reduce over y
2Th/G_x and over x 5Th/G_y, and 12h^2/(G_x G_y) gathered elements per weight
all-gather and weight-grad reduce-scatter over z. Collectives over groups of one rank
must not be issued at all.
"""

from __future__ import annotations

from collections import Counter

import torch

from axonn_launch.grid import Grid
from axonn_launch.models import ModelSpec
from axonn_launch.spec import OverlapConfig
from axonn_launch.train.groups import build_groups
from axonn_launch.train.model import GPT, finish_gradients
from tests.train.dist_utils import run_world

SPEC = ModelSpec("tiny", n_layer=2, d_model=32, n_head=4, vocab_size=61, max_seq_len=16)
MICRO_BATCH, SEQ = 8, 16
GRIDS = [Grid(x=2, y=2), Grid(x=2, z=2), Grid(y=2, z=2), Grid(z=4), Grid(x=4), Grid(data=2, y=2)]
OVERLAPS = [OverlapConfig(False, False, False), OverlapConfig(True, True, True)]


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
    def __init__(self, grid: Grid, spec: ModelSpec, tokens: int) -> None:
        self.grid, self.spec, self.t = grid, spec, tokens
        self.records: Counter = Counter()

    def add(self, op: str, axis: str, tag: str, numel: int) -> None:
        size = self.grid.x * self.grid.y if axis == "plane" else self.grid.size(axis)
        if size > 1:
            self.records[(op, axis, tag, numel)] += 1

    def linear_forward(self, tag: str, d_in: int, d_out: int, transpose: bool) -> None:
        inner, outer = ("y", "x") if transpose else ("x", "y")
        g = self.grid
        self.add("all_gather", "z", tag, d_out * d_in // (g.x * g.y))
        self.add("all_reduce", inner, tag, self.t * d_out // g.size(outer))

    def linear_backward(self, tag: str, d_in: int, d_out: int, transpose: bool) -> None:
        inner, outer = ("y", "x") if transpose else ("x", "y")
        g = self.grid
        self.add("all_gather", "z", tag, d_out * d_in // (g.x * g.y))
        self.add("all_reduce", outer, tag, self.t * d_in // g.size(inner))
        self.add("reduce_scatter", "z", tag, d_out * d_in // (g.x * g.y))

    def block_forward(self, layer: int) -> None:
        for norm in ("ln1", "ln2"):
            self.add("all_reduce", "x", f"blocks.{layer}.{norm}", 2 * self.t)
        for linear in _linears(self.spec, layer):
            self.linear_forward(*linear)

    def block_backward(self, layer: int) -> None:
        for norm in ("ln1", "ln2"):
            self.add("all_reduce", "x", f"blocks.{layer}.{norm}", 2 * self.t)
        for linear in _linears(self.spec, layer):
            self.linear_backward(*linear)

    def embedding_and_loss_forward(self, padded_vocab: int) -> None:
        h, plane = self.spec.d_model, self.grid.x * self.grid.y
        self.add("all_gather", "z", "wte", padded_vocab // plane * h)
        self.add("all_reduce", "plane", "embedding", self.t * h)
        self.add("all_reduce", "x", "ln_f", 2 * self.t)
        self.add("all_gather", "x", "lm_head", self.t * h)
        self.add("all_reduce_max", "plane", "cross_entropy", self.t)
        self.add("all_reduce", "plane", "cross_entropy", 2 * self.t)

    def embedding_and_loss_backward(self, padded_vocab: int) -> None:
        h, plane = self.spec.d_model, self.grid.x * self.grid.y
        self.add("all_reduce", "plane", "lm_head", self.t * h)
        self.add("all_reduce", "x", "ln_f", 2 * self.t)
        self.add("all_gather", "x", "embedding", self.t * h)
        self.add("reduce_scatter", "z", "wte", padded_vocab // plane * h)


def _as_counter(records) -> Counter:
    return Counter((r.op, r.axis, r.tag, r.numel) for r in records)


def _assert_table_volumes(rec_fwd, rec_bwd, grid, spec, tokens, recompute: bool, label) -> None:
    """Per-layer sums against the formulas of axonn.md section 2.7; with full recompute
    the backward pass also repeats the forward all-reduces and the weight all-gather."""
    t, h = tokens, spec.d_model
    for layer in range(spec.n_layer):
        linear_tags = [tag for tag, *_ in _linears(spec, layer)]

        def total(records: Counter, op: str, axis: str, tags=tuple(linear_tags)) -> int:
            return sum(n * count for (o, a, tag, n), count in records.items()
                       if o == op and a == axis and tag in tags)  # fmt: skip

        def on(axis, value):
            return value if grid.size(axis) > 1 else 0

        fwd_x, fwd_y = on("x", 7 * t * h // grid.y), on("y", 2 * t * h // grid.x)
        block = on("z", 12 * h * h // (grid.x * grid.y))
        again = 1 if recompute else 0
        assert total(rec_fwd, "all_reduce", "x") == fwd_x, label
        assert total(rec_fwd, "all_reduce", "y") == fwd_y, label
        assert total(rec_bwd, "all_reduce", "y") == on("y", 2 * t * h // grid.x) + again * fwd_y
        assert total(rec_bwd, "all_reduce", "x") == on("x", 5 * t * h // grid.y) + again * fwd_x
        assert total(rec_fwd, "all_gather", "z") == block, label
        # re-gathered in backward (and once more for the recomputed forward)
        assert total(rec_bwd, "all_gather", "z") == (1 + again) * block, label
        assert total(rec_bwd, "reduce_scatter", "z") == block, label


def _expected_grad_sync(model: GPT, grid: Grid) -> Counter:
    expected = Counter()
    params = list(model.parameters())
    if grid.z > 1:
        over_z = sum(p.numel() for p in params if "z" in p.shard_layout.replicated_over)
        expected[("all_reduce", "z", "grad_sync", over_z)] += 1
    if grid.data > 1:
        expected[("all_reduce", "data", "grad_sync", sum(p.numel() for p in params))] += 1
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


def _check_one(groups, grid, overlap, checkpointing, tokens, label) -> None:
    model = GPT(SPEC, groups=groups, overlap=overlap, activation_checkpointing=checkpointing)
    b_local = MICRO_BATCH // (grid.data * grid.z)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, SPEC.vocab_size, (b_local, SEQ), generator=gen)
    with model.comm.recording() as rec_fwd:
        loss = model(idx, idx)
    with model.comm.recording() as rec_bwd:
        loss.backward()
    with model.comm.recording() as rec_sync:
        finish_gradients(model, groups)

    padded = model.embedding.padded_vocab
    fwd, bwd = Expected(grid, SPEC, tokens), Expected(grid, SPEC, tokens)
    fwd.embedding_and_loss_forward(padded)
    for layer in range(SPEC.n_layer):
        fwd.block_forward(layer)
    for layer in reversed(range(SPEC.n_layer)):
        if checkpointing:
            bwd.block_forward(layer)  # the recomputed forward
        bwd.block_backward(layer)
    bwd.embedding_and_loss_backward(padded)
    got_fwd, got_bwd = _as_counter(rec_fwd.records), _as_counter(rec_bwd.records)
    if overlap.all_gather and grid.z > 1:
        # the forward already prefetches the weight that the backward needs first
        last_block = _linears(SPEC, SPEC.n_layer - 1)
        tag, d_in, d_out, _ = last_block[0] if checkpointing else last_block[-1]
        first = ("all_gather", "z", tag, d_in * d_out // (grid.x * grid.y))
        assert got_fwd - fwd.records == Counter([first]), f"{label} {got_fwd - fwd.records}"
        got_fwd[first] -= 1
        got_bwd[first] += 1
    assert got_fwd == fwd.records, f"{label} forward collectives {_diff(got_fwd, fwd.records)}"
    assert got_bwd == bwd.records, f"{label} backward collectives {_diff(got_bwd, bwd.records)}"
    assert _as_counter(rec_sync.records) == _expected_grad_sync(model, grid), f"{label} sync"
    _assert_table_volumes(got_fwd, got_bwd, grid, SPEC, tokens, checkpointing, label)
    assert all(r.group_size > 1 for r in rec_fwd.records + rec_bwd.records), label
    assert all(r.dtype == torch.float32 for r in rec_fwd.records), label


def test_collectives_match_the_layer_definitions_and_the_volume_table():
    results = run_world(_check_volumes, 4, timeout=600)
    assert results == [len(GRIDS) * len(OVERLAPS) * 2] * 4


def _diff(got: Counter, want: Counter) -> str:
    return f"unexpected {dict(got - want)}, missing {dict(want - got)}"
