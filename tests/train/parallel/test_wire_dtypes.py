"""Wire dtypes: where "auto" is resolved, what ``Comm`` sends, and a bf16 wire in fp32.

``resolve_wire`` is the one place that turns ``train.wire`` into torch dtypes. The
collectives that take a dtype send in it and return in it, and over a group of one
they neither send nor cast. An fp32 run with an explicit bf16 wire (the casts of
``TPLinear.gemm_weight`` and of the token table) gives the gradients of fp32 within
bf16 rounding, and not exactly those: the wire really rounds.
"""

from __future__ import annotations

import pytest
import torch

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig, WireConfig
from axonn_launch.train.models.gpt import GPT, finish_gradients, full_grad_dict
from axonn_launch.train.parallel.comm import FP32_WIRE, Comm, Wire, resolve_wire
from axonn_launch.train.parallel.groups import build_groups, single_process_groups
from tests.train.dist_utils import run_world

BF16, FP32 = torch.bfloat16, torch.float32
SPEC = ModelSpec("tiny", n_layer=2, d_model=32, n_head=4, vocab_size=61, max_seq_len=16)


def test_auto_follows_the_compute_dtype_and_explicit_values_win():
    assert resolve_wire(WireConfig(), BF16) == Wire(BF16, BF16, BF16)
    assert resolve_wire(WireConfig(), FP32) == FP32_WIRE == Wire(FP32, FP32, FP32)
    mixed = WireConfig(all_gather="bf16", reduce_scatter="fp32", all_reduce="auto")
    assert resolve_wire(mixed, FP32) == Wire(BF16, FP32, FP32)
    assert resolve_wire(mixed, BF16) == Wire(BF16, FP32, BF16)
    with pytest.raises(ValueError, match="train.wire.all_gather"):
        WireConfig(all_gather="fp16")


def test_a_group_of_one_sends_nothing_and_casts_nothing():
    comm = Comm(single_process_groups())
    t = torch.randn(8)
    with comm.recording() as rec:
        assert comm.all_gather(t, "z", dtype=BF16)[0] is t
        assert comm.reduce_scatter(t, "z", dtype=BF16)[0] is t
        assert comm.all_reduce_as(t, "x", BF16)[0] is t
    assert rec.records == []


def _collectives_in_bf16(rank: int, world: int) -> dict:
    comm = Comm(build_groups(Grid(z=2), rank=rank))
    value = torch.tensor([1.0 + 2**-10, 3.0, -2.0, 0.5]) * (rank + 1)  # 1 + 2^-10 rounds
    with comm.recording() as rec:
        gathered, _ = comm.all_gather(value, "z", dtype=BF16)
        shard, _ = comm.reduce_scatter(value.clone(), "z", dtype=BF16)
        summed, _ = comm.all_reduce_as(value, "z", BF16)
    return {"gathered": gathered, "shard": shard, "summed": summed, "value": value,
            "records": [(r.op, r.numel, r.dtype, r.bytes) for r in rec.records]}  # fmt: skip


def test_collectives_send_and_return_the_wire_dtype():
    results = run_world(_collectives_in_bf16, 2)
    values = [r["value"] for r in results]
    as_sent = [v.to(BF16) for v in values]
    total = (as_sent[0] + as_sent[1]).to(BF16)
    for rank, r in enumerate(results):
        assert torch.equal(r["gathered"], torch.cat(as_sent))
        assert torch.equal(r["shard"], total.chunk(2)[rank])
        assert torch.equal(r["summed"], total)
        assert torch.equal(r["value"], values[rank])  # the input is left as it was
        assert r["records"] == [("all_gather", 8, BF16, 16), ("reduce_scatter", 4, BF16, 8),
                                ("all_reduce", 4, BF16, 8)]  # fmt: skip
    assert not torch.equal(total.float(), values[0] + values[1])  # bf16 did round


def _gradient_gaps(rank: int, world: int, grid: Grid) -> list[tuple[str, float, float, bool]]:
    """Per parameter: (name, max |bf16 wire - fp32 wire|, max |fp32 wire|, identical)."""
    groups = build_groups(grid, rank=rank)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, SPEC.vocab_size, (8, 17), generator=gen)
    local = tokens.chunk(grid.z)[grid.coords(rank).z]
    grads = []
    for wire in (FP32_WIRE, Wire(BF16, BF16, BF16)):
        model = GPT(SPEC, groups=groups, overlap=OverlapConfig(), wire=wire, seed=2)
        model(local[:, :-1], local[:, 1:]).backward()
        finish_gradients(model, groups)
        grads.append(full_grad_dict(model, groups))
    fp32, bf16 = grads
    return [(name, float((bf16[name] - want).abs().max()), float(want.abs().max()),
             torch.equal(bf16[name], want)) for name, want in fp32.items()]  # fmt: skip


@pytest.mark.parametrize("grid", [Grid(x=2, z=2), Grid(y=2, z=2)], ids=lambda g: g.describe())
def test_a_bf16_wire_in_an_fp32_run_rounds_only(grid):
    gaps = run_world(_gradient_gaps, 4, grid)[0]
    for name, gap, scale, _ in gaps:
        # bf16 keeps 8 significant bits: a few roundoffs (2^-9 each) of the largest entry
        # (measured: at most 7e-3 of it on both grids)
        assert gap <= 2e-2 * scale, f"{name}: {gap:.2e} of {scale:.2e}"
    rounded = sum(not identical for *_, identical in gaps)
    assert rounded > len(gaps) // 2  # most gradients saw bf16 on the way
