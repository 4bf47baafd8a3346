"""The memory model against hand-computed cases."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig, TrainConfig, WireConfig
from axonn_launch.cost.memory import (
    GIB,
    RUNTIME_RESERVE_GIB,
    MemoryEstimate,
    estimate_memory,
    largest_cache_that_fits,
    layer_activation_bytes,
    local_param_elements,
    replicated_over_z_elements,
)

FP32_WIRE = WireConfig(all_gather="fp32", reduce_scatter="fp32", all_reduce="fp32")

MODEL = ModelSpec("m", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=32)
GPT_80B = ModelSpec("gpt_80b", n_layer=42, d_model=12288, n_head=96, vocab_size=50304,
                    max_seq_len=2048)  # fmt: skip


def train(**kw) -> TrainConfig:
    base = dict(global_batch=8, micro_batch=4, seq_len=32)
    base.update(kw)
    return TrainConfig(**base)


def test_unsharded_local_parameters_are_the_model():
    assert local_param_elements(MODEL, Grid()) == MODEL.n_params()
    assert local_param_elements(GPT_80B, Grid(data=64)) == GPT_80B.n_params()


def test_sharded_parameters_hand_case():
    # x=2, y=2, z=2, h=64, f=256, l=2, V=256, S=32
    grid = Grid(x=2, y=2, z=2)
    linear = 2 * (4 * 64 * 64 + 2 * 64 * 256) / 8  # Linear weights over x*y*z
    table = 256 / 4 * 64 / 2  # vocab rows over the plane, then z
    per_layer = 3 * 64 / 2 + 64 / 2 + 256 / 2 + 64 / 2 + 4 * 64 / 2  # biases + norms
    rest = 2 * per_layer + 32 * 64 / 2 + 2 * 64 / 2  # + positions + final norm
    assert replicated_over_z_elements(MODEL, grid) == rest
    assert local_param_elements(MODEL, grid) == linear + table + rest


def test_parameter_state_is_sixteen_bytes_per_local_element():
    grid = Grid(x=2, z=2)
    est = estimate_memory(model=MODEL, grid=grid, train=train())
    local = local_param_elements(MODEL, grid)
    assert est.terms["parameters"] == local * 4
    assert est.terms["gradients"] == local * 4
    assert est.terms["optimizer"] == local * 8
    assert est.terms["runtime reserve"] == RUNTIME_RESERVE_GIB * GIB


def test_layer_activation_hand_case():
    # T=128, h=64, f=256, 4 heads, x=y=2, bf16:
    # x-sharded, 4 fp32 tensors (the x > 1 LayerNorm saves its input only): 128*32*4*4 = 65,536
    # y-sharded: 128*(4*64*2 + 2*256*4)/2 = 163,840 ; log-sum-exp: 128*2*4 = 1,024
    # LayerNorm statistics (mean, variance, inverse deviation): 128*2*3*4 = 3,072
    expected = 65_536 + 163_840 + 1_024 + 3_072
    assert layer_activation_bytes(MODEL, Grid(x=2, y=2), 128, 2) == expected


def test_activations_scale_with_tokens_per_gpu():
    tr = train(micro_batch=8)
    one = estimate_memory(model=MODEL, grid=Grid(z=2), train=tr).terms
    two = estimate_memory(model=MODEL, grid=Grid(z=4), train=tr).terms
    assert two["activations"] == pytest.approx(one["activations"] / 2)
    assert two["logits"] == pytest.approx(one["logits"] / 2)


def test_activation_checkpointing_keeps_layer_inputs_and_one_layer():
    grid, tr = Grid(x=2), train(micro_batch=8, seq_len=32)
    tokens = 8 * 32
    full = estimate_memory(model=GPT_80B, grid=grid, train=tr).terms["activations"]
    ckpt = estimate_memory(
        model=GPT_80B, grid=grid, train=dataclasses.replace(tr, activation_checkpointing=True)
    ).terms["activations"]
    one = layer_activation_bytes(GPT_80B, grid, tokens, 2)
    assert full == pytest.approx(42 * one)
    assert ckpt == pytest.approx(42 * tokens * 12288 / 2 * 4 + one)
    assert ckpt < full


def test_reduce_scatter_buffers():
    tr = train()  # ORS window 2 = both of MODEL's blocks; bf16 on the wire
    block = 4 * 64 * 64 + 2 * 64 * 256  # one layer's dW blocks over x*y=2: elements * 2
    assert estimate_memory(model=MODEL, grid=Grid(x=2), train=tr).terms[
        "reduce-scatter buffers"
    ] == 0  # fmt: skip
    ors = estimate_memory(model=MODEL, grid=Grid(x=2, z=4), train=tr).terms
    assert ors["reduce-scatter buffers"] == pytest.approx(2 * block / 2 * 2 * (1 + 1 / 4))
    no_ors = dataclasses.replace(tr, overlap=OverlapConfig(reduce_scatter=False))
    one = estimate_memory(model=MODEL, grid=Grid(x=2, z=4), train=no_ors).terms
    mlp = 64 * 256 / 2  # the largest Linear block, h*f/(x*y)
    assert one["reduce-scatter buffers"] == pytest.approx(mlp * 2 * (1 + 1 / 4))


@pytest.mark.parametrize(("window", "blocks"), [(1, 1), (2, 2), (5, 5), (0, 42), (100, 42)])
def test_the_ors_window_keeps_that_many_blocks_of_gradient_buffers(window, blocks):
    grid = Grid(x=4, y=4, z=8)
    tr = TrainConfig(global_batch=512, micro_batch=8, seq_len=2048, ors_window=window)
    per_block = (4 * 12288**2 + 2 * 12288 * 49152) / 16  # elements over x*y
    bf16 = estimate_memory(model=GPT_80B, grid=grid, train=tr).terms["reduce-scatter buffers"]
    assert bf16 == pytest.approx(blocks * per_block * 2 * (1 + 1 / 8))
    fp32 = dataclasses.replace(tr, wire=FP32_WIRE)
    wide = estimate_memory(model=GPT_80B, grid=grid, train=fp32).terms["reduce-scatter buffers"]
    assert wide == pytest.approx(2 * bf16)


def test_gathered_weights_are_held_in_the_all_gather_dtype():
    grid, mlp, table = Grid(x=2, z=2), 64 * 256 / 2, 256 / 2 * 64

    def terms(**kw):
        return estimate_memory(model=MODEL, grid=grid, train=train(**kw)).terms

    bf16 = terms()  # in use + prefetched, already bf16: no autocast copy
    assert bf16["weight buffers"] == 2 * 2 * mlp and bf16["embedding buffers"] == 2 * table
    fp32_wire = terms(wire=WireConfig(all_gather="fp32"))  # fp32 blocks + autocast's bf16 copy
    assert fp32_wire["weight buffers"] == (2 * 4 + 2) * mlp
    assert fp32_wire["embedding buffers"] == (4 + 2) * table
    fp32_run = terms(dtype="fp32")  # fp32 everywhere, no copy
    assert fp32_run["weight buffers"] == 2 * 4 * mlp and fp32_run["embedding buffers"] == 4 * table


def test_cached_blocks_keep_their_gathered_weights():
    grid = Grid(x=2, z=4)
    block = (4 * 64 * 64 + 2 * 64 * 256) / 2  # elements of one block's weights over x*y
    for n, kept in ((0, 0), (1, 1), (2, 2), (9, 2)):  # at most n_layer blocks
        est = estimate_memory(model=MODEL, grid=grid, train=train(cache_layers=n)).terms
        assert est["weight cache"] == kept * block * 2
    fp32 = estimate_memory(model=MODEL, grid=grid, train=train(cache_layers=1, wire=FP32_WIRE))
    assert fp32.terms["weight cache"] == block * 4
    no_z = estimate_memory(model=MODEL, grid=Grid(x=2), train=train(cache_layers=2))
    assert no_z.terms["weight cache"] == 0  # z == 1: nothing is gathered, nothing kept


def test_the_largest_cache_that_fits_is_the_last_that_fits():
    tr = TrainConfig(global_batch=512, micro_batch=64, seq_len=2048, activation_checkpointing=True)
    grid = Grid(x=1, y=2, z=64, data=8)
    n = largest_cache_that_fits(GPT_80B, grid, tr, 40)
    assert 0 < n < GPT_80B.n_layer

    def fits(k: int) -> bool:
        return estimate_memory(model=GPT_80B, grid=grid, train=train_with(tr, k)).fits(40)

    assert fits(n) and not fits(n + 1)
    assert largest_cache_that_fits(GPT_80B, grid, tr, 0) == GPT_80B.n_layer  # unbounded
    assert largest_cache_that_fits(GPT_80B, grid, tr, 1) == 0  # nothing fits at all
    assert largest_cache_that_fits(GPT_80B, Grid(x=4, y=4, data=64), tr, 1000) == 0  # z == 1


def train_with(tr: TrainConfig, cache: int) -> TrainConfig:
    return dataclasses.replace(tr, cache_layers=cache)


def test_fp32_runs_use_more_activation_memory():
    bf16 = estimate_memory(model=MODEL, grid=Grid(), train=train()).terms["activations"]
    fp32 = estimate_memory(model=MODEL, grid=Grid(), train=train(dtype="fp32")).terms
    assert fp32["activations"] > bf16


def test_sharding_an_80b_model_makes_it_fit_a_40gb_gpu():
    tr = TrainConfig(global_batch=512, micro_batch=8, seq_len=2048, activation_checkpointing=True)
    alone = estimate_memory(model=GPT_80B, grid=Grid(x=4, y=4), train=tr)
    spread = estimate_memory(model=GPT_80B, grid=Grid(x=4, y=4, z=8), train=tr)
    assert not alone.fits(40)  # 16 bytes * 80e9 / 16 = 80 GB of state alone
    assert spread.fits(40)


def test_estimate_api():
    est = MemoryEstimate(terms={"a": 1 * GIB, "b": 3 * GIB})
    assert est.total == 4 * GIB
    assert est.biggest() == ("b", 3 * GIB)
    assert est.describe() == "4.0 GiB per GPU (largest term: b 3.0 GiB)"
    assert est.fits(0) and est.fits(4) and not est.fits(3.9)


@pytest.mark.parametrize(
    "grid",
    [Grid(), Grid(x=2, y=2, z=2), Grid(x=4, z=2), Grid(y=4, z=4), Grid(x=2, y=4, z=8, data=2)],
    ids=lambda g: g.describe(),
)
def test_local_parameters_match_the_training_core(grid):
    """Build one rank's shard of the core's GPT (no process group is needed to shard)."""
    from axonn_launch.train.models.gpt import GPT
    from axonn_launch.train.parallel.groups import Groups

    odd_vocab = dataclasses.replace(MODEL, vocab_size=250)  # padded to a multiple of x*y
    last = grid.world_size - 1
    groups = Groups(grid=grid, rank=last, coords=grid.coords(last), x=None, y=None, z=None,
                    data=None, plane=None)  # fmt: skip
    model = GPT(odd_vocab, groups=groups, overlap=OverlapConfig())
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == local_param_elements(odd_vocab, grid)
    replicated = sum(p.numel() for p in params if "z" in p.shard_layout.replicated_over)
    assert replicated == replicated_over_z_elements(odd_vocab, grid)


def saved_bytes_of_one_block(grid: Grid, rank: int, bf16: bool) -> int:
    """Bytes of the tensors block 0 of the core's GPT saves for backward (not parameters)."""
    import torch

    from axonn_launch.train.models.gpt import GPT
    from axonn_launch.train.parallel.attention import Positions
    from axonn_launch.train.parallel.groups import build_groups

    model = GPT(MODEL, groups=build_groups(grid, rank=rank), overlap=OverlapConfig())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    hidden = torch.randn(4, 32, MODEL.d_model // grid.x, requires_grad=True)
    model.runtime.begin_micro_step(training=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.blocks[0](hidden, Positions())
    model.runtime.drop_prefetched()
    return sum(storages.values())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_activation_formula_matches_the_saved_tensors_of_one_process(bf16):
    saved = saved_bytes_of_one_block(Grid(), 0, bf16)
    assert saved == layer_activation_bytes(MODEL, Grid(), 4 * 32, 2 if bf16 else 4)


def _saved_bytes_worker(rank: int, port: int, grid: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        saved = saved_bytes_of_one_block(Grid(**grid), rank, bf16=True)
        if rank == 0:
            Path(out).write_text(str(saved))
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("grid", [Grid(x=2), Grid(y=2)], ids=lambda g: g.describe())
def test_activation_formula_matches_the_saved_tensors_of_a_sharded_layer(grid, tmp_path):
    import socket

    import torch.multiprocessing as mp

    from tests.train.dist_utils import forkserver_context

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "saved"
    forkserver_context()  # children fork from the server that has torch imported already
    args = (port, grid.as_dict(), str(out))
    mp.start_processes(_saved_bytes_worker, args=args, nprocs=2, start_method="forkserver")
    assert int(out.read_text()) == layer_activation_bytes(MODEL, grid, 4 * 32, 2)
