"""Per-block collective traffic against an independent transcription of axonn.md §2.7."""

from __future__ import annotations

import pytest

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import TrainConfig, WireConfig
from axonn_launch.common.traffic import (
    ALL_GATHER,
    ALL_REDUCE,
    BACKWARD,
    FORWARD,
    RECOMPUTE,
    REDUCE_SCATTER,
    WireBytes,
    block_collectives,
    block_volumes,
    is_cached,
    wire_bytes,
)

MODEL = ModelSpec("m", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=32)
H = 64
GRID = Grid(x=2, y=4, z=2)
T = 4 / 2 * 32  # micro_batch / z * seq_len
WEIGHTS = 12 * H * H / (2 * 4)  # one block's four Linear blocks over x*y (f = 4h)


def train(**kw) -> TrainConfig:
    base = dict(global_batch=8, micro_batch=4, seq_len=32, activation_checkpointing=True)
    base.update(kw)
    return TrainConfig(**base)


def test_auto_wire_follows_the_compute_dtype():
    assert wire_bytes(train(), on_gpu=True) == WireBytes(2, 2, 2, 2, 4)
    assert wire_bytes(train(), on_gpu=False) == WireBytes(4, 4, 4, 4, 4)  # auto is fp32 on CPU
    assert wire_bytes(train(dtype="fp32"), on_gpu=True) == WireBytes(4, 4, 4, 4, 4)
    assert wire_bytes(train(dtype="bf16"), on_gpu=False) == WireBytes(2, 2, 2, 2, 4)
    mixed = train(dtype="fp32", wire=WireConfig(all_gather="bf16", all_reduce="bf16"))
    assert wire_bytes(mixed, on_gpu=True) == WireBytes(4, 2, 4, 2, 4)
    fp32_wire = train(wire=WireConfig(all_gather="fp32", reduce_scatter="fp32", all_reduce="fp32"))
    assert wire_bytes(fp32_wire, on_gpu=True) == WireBytes(2, 4, 4, 4, 4)


def test_bf16_volumes_are_the_corrected_axonn_table():
    """axonn.md §2.7 with recompute: x carries 19Th/y (forward 2 x 7Th/y, dX 5Th/y), y
    6Th/x (forward 2 x 2Th/x, dX 2Th/x); z gathers 12h^2/(xy) in the forward and the
    recompute (whose gather the backward reuses), and reduce-scatters it once. LayerNorm
    statistics, 2 norms each, fp32: forward and recompute all-gather 3 numbers per token
    and x rank, the backward all-reduces 2 per token."""
    v = block_volumes(MODEL, GRID, train(), on_gpu=True)
    assert v == {
        (ALL_REDUCE, "x", 2): 19 * T * H / 4,
        (ALL_REDUCE, "y", 2): 6 * T * H / 2,
        (ALL_REDUCE, "x", 4): 2 * 2 * T,
        (ALL_GATHER, "x", 4): 2 * 2 * 3 * T * 2,
        (ALL_GATHER, "z", 2): 2 * WEIGHTS,
        (REDUCE_SCATTER, "z", 2): WEIGHTS,
    }


def test_fp32_wire_moves_the_dx_and_weight_traffic_to_four_bytes():
    fp32 = WireConfig(all_gather="fp32", reduce_scatter="fp32", all_reduce="fp32")
    v = block_volumes(MODEL, GRID, train(wire=fp32), on_gpu=True)
    assert v[(ALL_REDUCE, "x", 2)] == 2 * 7 * T * H / 4  # forward outputs stay bf16
    assert v[(ALL_REDUCE, "x", 4)] == 5 * T * H / 4 + 4 * T  # dX + LayerNorm backward
    assert v[(ALL_REDUCE, "y", 2)] == 2 * 2 * T * H / 2
    assert v[(ALL_REDUCE, "y", 4)] == 2 * T * H / 2
    assert v[(ALL_GATHER, "z", 4)] == 2 * WEIGHTS and v[(REDUCE_SCATTER, "z", 4)] == WEIGHTS


@pytest.mark.parametrize(("ckpt", "uncached", "cached"), [(True, 2, 1), (False, 2, 1)])
def test_a_cached_block_gathers_only_in_the_forward(ckpt, uncached, cached):
    tr = train(activation_checkpointing=ckpt)
    plain = block_volumes(MODEL, GRID, tr, on_gpu=True)
    kept = block_volumes(MODEL, GRID, tr, on_gpu=True, cached=True)
    assert plain[(ALL_GATHER, "z", 2)] == uncached * WEIGHTS
    assert kept[(ALL_GATHER, "z", 2)] == cached * WEIGHTS
    assert kept[(REDUCE_SCATTER, "z", 2)] == plain[(REDUCE_SCATTER, "z", 2)] == WEIGHTS
    gathers = [c for c in block_collectives(MODEL, GRID, tr, on_gpu=True, cached=True)
               if c.op == ALL_GATHER and c.axis == "z"]  # fmt: skip
    assert {c.phase for c in gathers} == {FORWARD}


def test_axes_of_one_rank_send_nothing_and_phases_are_labelled():
    v = block_volumes(MODEL, Grid(y=2, data=2), train(micro_batch=2), on_gpu=True)
    assert {axis for _, axis, _ in v} == {"y"}
    phases = {c.phase for c in block_collectives(MODEL, GRID, train(), on_gpu=True)}
    assert phases == {FORWARD, RECOMPUTE, BACKWARD}
    no_ckpt = block_collectives(MODEL, GRID, train(activation_checkpointing=False), on_gpu=True)
    assert RECOMPUTE not in {c.phase for c in no_ckpt}


def test_the_first_blocks_are_cached():
    tr = train(cache_layers=1)
    assert [is_cached(tr, i) for i in range(2)] == [True, False]
    assert not is_cached(train(), 0) and not is_cached(train(cache_layers=None), 0)


def test_an_automatic_micro_batch_must_be_resolved_first():
    with pytest.raises(ValueError, match="micro-batch is automatic"):
        block_collectives(MODEL, GRID, train(micro_batch=None), on_gpu=True)
