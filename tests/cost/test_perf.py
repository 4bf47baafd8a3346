"""The step-time model against hand-computed cases and the training core's own traffic."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import Hardware
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig, TrainConfig, WireConfig
from axonn_launch.common.traffic import NORM, block_collectives
from axonn_launch.cost.memory import local_param_elements
from axonn_launch.cost.perf import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    BandwidthSample,
    Calibration,
    Gemm,
    Placement,
    block_gemms,
    bus_bandwidth,
    elementwise_elements,
    gemm_seconds,
    load_calibration,
    log_interpolate,
    partly_hidden,
    pipelined_exposed,
    placement,
    ring_time,
    step_time,
    stream_exposed,
)

HW = Hardware(
    gpus_per_node=4,
    gpu_model="A100",
    mem_per_gpu_gb=40,
    peak_tflops_per_gpu=1.0,
    intra_node_gbps=100,
    inter_node_gbps=25,
    latency_us=5,
)
MODEL = ModelSpec("m", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=32)
EXACT = Calibration(gemm_efficiency=1.0, kernel_overhead_us=0.0)  # GEMM time = FLOPs / peak
NO_OVERLAP = OverlapConfig(all_reduce=False, reduce_scatter=False, all_gather=False)


def train(**kw) -> TrainConfig:
    base = dict(global_batch=8, micro_batch=4, seq_len=32, activation_checkpointing=False)
    base.update(kw)
    return TrainConfig(**base)


# --------------------------------------------------------------------------- ring costs


def test_ring_all_reduce_and_all_gather_costs():
    # all-reduce, p=4, 1 GB at 100 GB/s, 5 us per step: 6 steps + 2*3/4 * 1e9 / 1e11
    assert ring_time(ALL_REDUCE, 4, 1e9, 100, 5e-6) == pytest.approx(6 * 5e-6 + 0.015)
    # all-gather / reduce-scatter: 3 steps + 3/4 * 1e9 / 1e11
    assert ring_time(ALL_GATHER, 4, 1e9, 100, 5e-6) == pytest.approx(3 * 5e-6 + 0.0075)
    assert ring_time(REDUCE_SCATTER, 4, 1e9, 100, 5e-6) == pytest.approx(3 * 5e-6 + 0.0075)
    assert ring_time(ALL_REDUCE, 1, 1e9, 100, 5e-6) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        ring_time("broadcast", 4, 1.0, 1.0, 0.0)


def test_placement_follows_the_rank_layout():
    grid = Grid(data=2, x=2, y=4, z=2)  # strides: x 1, y 2, z 8, data 16
    assert placement(grid, "x", 4) == Placement(size=2, per_node=2)  # inside a node
    assert placement(grid, "y", 4) == Placement(size=4, per_node=2)  # 2 per node, 2 nodes
    assert placement(grid, "z", 4) == Placement(size=2, per_node=1)
    assert placement(grid, "data", 4) == Placement(size=2, per_node=1)
    assert placement(grid, "xy", 4) == Placement(size=8, per_node=4)
    small = Grid(x=2, y=2, z=2)  # 8 ranks on one 8-GPU node: everything inside
    assert all(placement(small, a, 8).intra_node for a in ("x", "y", "z", "data", "xy"))


def test_cross_node_groups_share_the_injection_bandwidth():
    assert bus_bandwidth(HW, Placement(4, 4), ALL_REDUCE) == pytest.approx((100, 5e-6))
    assert bus_bandwidth(HW, Placement(8, 2), ALL_REDUCE)[0] == 50  # 2 ranks x 25 GB/s
    assert bus_bandwidth(HW, Placement(8, 1), ALL_REDUCE)[0] == 25
    fat = dataclasses.replace(HW, inter_node_gbps=60)
    assert bus_bandwidth(fat, Placement(8, 4), ALL_REDUCE)[0] == 100  # capped by intra links


def test_measured_bandwidth_wins_and_nearest_sample_is_used():
    cal = Calibration(
        collectives=(
            BandwidthSample(ALL_REDUCE, size=4, per_node=4, bus_gbps=7.0, alpha_us=20.0),
            BandwidthSample(ALL_REDUCE, size=16, per_node=1, bus_gbps=3.0, alpha_us=30.0),
        )
    )
    assert bus_bandwidth(HW, Placement(4, 4), ALL_REDUCE, cal) == pytest.approx((7.0, 20e-6))
    assert bus_bandwidth(HW, Placement(2, 2), ALL_REDUCE, cal) == pytest.approx(
        (7.0, 20e-6)
    )  # nearest intra
    assert bus_bandwidth(HW, Placement(64, 1), ALL_REDUCE, cal) == pytest.approx((3.0, 30e-6))
    # no sample of that kind: the hardware numbers
    assert bus_bandwidth(HW, Placement(4, 4), ALL_GATHER, cal) == pytest.approx((100, 5e-6))


def test_gemm_time_from_peak_or_interpolated_measurements():
    assert gemm_seconds(2e12, HW, EXACT) == pytest.approx(2.0)
    slow = Calibration(gemm_efficiency=0.5, kernel_overhead_us=3.0)
    assert gemm_seconds(1e12, HW, slow) == pytest.approx(2.0 + 3e-6)
    cal = Calibration(gemm=((1e6, 1.0), (1e8, 3.0)))
    assert cal.gemm_tflops(1e7) == pytest.approx(2.0)  # halfway in log(FLOPs)
    assert cal.gemm_tflops(1e3) == 1.0 and cal.gemm_tflops(1e12) == 3.0  # clamped
    assert gemm_seconds(1e7, HW, cal) == pytest.approx(1e7 / 2e12)


def test_load_calibration_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(
        json.dumps(
            {
                "gemm": [[1e9, 50.0], [1e11, 150.0]],
                "gemm_shapes": [
                    {"op": "dw", "m": 8, "n": 4, "k": 16, "tflops": {"direct": 3.0, "x": 5.0}}
                ],
                "overlap": {"efficiency": 0.25},
                "elementwise": [[1e3, 5.0], [1e6, 20.0]],
                "collectives": [
                    {
                        "collective": "all_gather",
                        "size": 8,
                        "per_node": 2,
                        "bus_gbps": 40.0,
                        "alpha_us": 12.0,
                    }  # fmt: skip
                ],
            }
        )
    )
    cal = load_calibration(path)
    assert cal.gemm == ((1e9, 50.0), (1e11, 150.0))
    dw = Gemm("dw", "fc1", 8, 4, 16)
    assert cal.shape_tflops(dw, tuned=True) == 5.0 and cal.shape_tflops(dw, tuned=False) == 3.0
    assert cal.collectives == (BandwidthSample(ALL_GATHER, 8, 2, 40.0, 12.0),)
    assert cal.source == str(path)
    assert cal.overlap_efficiency == 0.25
    assert cal.memory_gbps(1e3) == 5.0 and cal.memory_gbps(10**4.5) == pytest.approx(12.5)
    assert log_interpolate((), 1.0) is None and cal.memory_gbps(1e9) == 20.0  # clamped
    path.write_text(json.dumps({"gemm": []}))
    assert load_calibration(path).overlap_efficiency == 1.0  # older files: full overlap


def test_pipelined_exposure():
    assert pipelined_exposed(1.0, 2.0, 4) == 1.0  # compute hides all but the first
    assert pipelined_exposed(3.0, 1.0, 4) == pytest.approx(3 + 3 * 2)
    assert pipelined_exposed(0.0, 1.0, 4) == 0.0


def test_partly_hidden_scales_what_overlap_hides():
    assert partly_hidden(4.0, 1.0, 1.0) == 1.0  # perfect: only the exposed part remains
    assert partly_hidden(4.0, 1.0, 0.0) == 4.0  # none: the whole collective
    assert partly_hidden(4.0, 1.0, 0.5) == 2.5  # half of the 3 s that could hide


def test_overlap_efficiency_hand_case_for_the_backward_all_reduces():
    slow = dataclasses.replace(HW, peak_tflops_per_gpu=1e-6, latency_us=0.0)  # GEMMs dominate
    grid, tr = Grid(y=2), train()
    full = step_time(hardware=slow, model=MODEL, train=tr, grid=grid)
    none = step_time(hardware=slow, model=MODEL, train=tr, grid=grid,
                     calibration=Calibration(overlap_efficiency=0.0))  # fmt: skip
    half = step_time(hardware=slow, model=MODEL, train=tr, grid=grid,
                     calibration=Calibration(overlap_efficiency=0.5))  # fmt: skip
    raw = full.comm_raw["y"]
    assert none.comm["y"] == pytest.approx(raw)  # nothing hidden
    assert full.comm["y"] == pytest.approx(raw / 2)  # the backward half hidden (bf16 both)
    assert half.comm["y"] == pytest.approx(raw - 0.5 * (raw / 2))
    # OAG and ORS on a z grid: with e = 0 every gather and reduce-scatter is exposed.
    z_full = step_time(hardware=slow, model=MODEL, train=tr, grid=Grid(z=2))
    z_none = step_time(hardware=slow, model=MODEL, train=tr, grid=Grid(z=2),
                       calibration=Calibration(overlap_efficiency=0.0))  # fmt: skip
    assert z_none.comm["z"] == pytest.approx(z_none.comm_raw["z"])
    assert z_full.comm["z"] < z_none.comm["z"]


# --------------------------------------------------------------------------- volumes


def test_the_step_prices_every_collective_of_the_traffic_list():
    """Raw x, y and z seconds of the blocks are the ring costs of traffic.block_collectives
    (the embedding and head traffic is computed on a grid with z and x*y of one rank)."""
    hw = dataclasses.replace(HW, latency_us=0.0)
    grid, tr = Grid(y=2, z=2, data=2), train(global_batch=8, micro_batch=2)
    st = step_time(hardware=hw, model=MODEL, train=tr, grid=grid)
    expected = dict.fromkeys(("y", "z"), 0.0)
    for c in block_collectives(MODEL, grid, tr, on_gpu=True):
        gbps = 100.0  # y (stride 1) and z (stride 2) stay inside a 4-GPU node
        p = grid.size(c.axis)
        factor = 2 * (p - 1) / p if c.op == ALL_REDUCE else (p - 1) / p
        expected[c.axis] += factor * c.nbytes / (gbps * 1e9)
    blocks_z = MODEL.n_layer * expected["z"] * st.accumulation
    table = 256 // 2 * 64 * 2  # token-table block over the plane, bf16, gathered + scattered
    head_z = 2 * (1 / 2) * table / 100e9 * st.accumulation
    grads_z = 2 * (1 / 2) * 4 * (2 * (3 * 64 / 2 + 64 + 256 / 2 + 64 + 4 * 64) + 32 * 64 + 2 * 64)
    assert st.comm_raw["z"] == pytest.approx(blocks_z + head_z + grads_z / 100e9)
    assert st.comm_raw["y"] == pytest.approx(MODEL.n_layer * expected["y"] * st.accumulation)


def test_bf16_wire_halves_the_weight_traffic():
    hw = dataclasses.replace(HW, latency_us=0.0)
    grid = Grid(x=2, z=4)
    bf16 = step_time(hardware=hw, model=MODEL, train=train(), grid=grid)
    fp32_z = WireConfig(all_gather="fp32", reduce_scatter="fp32")
    fp32 = step_time(hardware=hw, model=MODEL, train=train(wire=fp32_z), grid=grid)
    grads = step_time(hardware=hw, model=MODEL, train=train(global_batch=4), grid=grid)
    once = grads.comm_raw["z"] - bf16.comm_raw["z"] / 2  # the gradient all-reduce over z
    assert fp32.comm_raw["z"] - 2 * once == pytest.approx(2 * (bf16.comm_raw["z"] - 2 * once))
    assert fp32.comm_raw["x"] == bf16.comm_raw["x"]


def test_caching_removes_the_second_gather_of_the_cached_blocks():
    """Uncached blocks gather twice per micro-step (forward, and the backward re-gather
    or the recompute whose gather the backward reuses); cached ones once."""
    hw = dataclasses.replace(HW, latency_us=0.0)
    grid = Grid(x=2, z=4)
    for ckpt, removed in ((True, 1), (False, 1)):
        tr = train(activation_checkpointing=ckpt)
        plain = step_time(hardware=hw, model=MODEL, train=tr, grid=grid)
        kept = dataclasses.replace(tr, cache_layers=1)
        one = step_time(hardware=hw, model=MODEL, train=kept, grid=grid)
        block = (4 * 64 * 64 + 2 * 64 * 256) / 2 * 2  # one block's gathered bytes, bf16
        gather = 3 / 4 * block / 50e9  # ring over z=4 (stride 2): 2 per node, 2 x 25 GB/s
        assert plain.comm_raw["z"] - one.comm_raw["z"] == pytest.approx(
            removed * gather * plain.accumulation
        )
        assert one.comm["z"] <= plain.comm["z"] and one.compute == plain.compute


def test_the_ors_window_changes_memory_not_the_predicted_time():
    grid = Grid(x=2, z=4)
    times = {w: step_time(hardware=HW, model=MODEL, train=train(ors_window=w), grid=grid).total
             for w in (0, 1, 2)}  # fmt: skip
    assert times[0] == times[1] == times[2]


def test_block_gemm_shapes():
    h, f, t = 64, 256, 128
    gemms = block_gemms(MODEL, Grid(x=2, y=4), t)
    by = {(g.linear, g.op): (g.m, g.n, g.k) for g in gemms}
    assert by["qkv", "fwd"] == (t, 3 * h // 4, h // 2)  # X[T, h/x] @ W^T[h/x, 3h/y]
    assert by["qkv", "dx"] == (t, h // 2, 3 * h // 4)
    assert by["qkv", "dw"] == (3 * h // 4, h // 2, t)
    assert by["proj", "fwd"] == (t, h // 2, h // 4)  # transposed: in over y, out over x
    assert by["fc2", "fwd"] == (t, h // 2, f // 4)
    assert sum(g.flops for g in gemms) == 3 * 2 * t * 12 * h * h / 8


def test_measured_gemm_shapes_are_used_tuned_or_plain():
    tr, grid = train(), Grid(data=2)
    rates = {"direct": 0.5, "transposed": 2.0}
    shapes = {(g.op, g.m, g.n, g.k): dict(rates) for g in block_gemms(MODEL, grid, 4 * 32)}
    cal = Calibration(gemm_efficiency=1.0, kernel_overhead_us=0.0, gemm_shapes=shapes)
    base = step_time(hardware=HW, model=MODEL, train=tr, grid=grid, calibration=EXACT)
    tuned = step_time(hardware=HW, model=MODEL, train=tr, grid=grid, calibration=cal)
    plain = step_time(hardware=HW, model=MODEL, train=dataclasses.replace(tr, gemm_tuning=False),
                      grid=grid, calibration=cal)  # fmt: skip
    assert base.accumulation == 1
    # 3 GEMMs per Linear, 2 layers, at 1 TFLOP/s; the LM head's [T, h] x [h, V] GEMMs have
    # MLP-up's shapes here (V = f = 256), so their measured rates apply too
    linear_s = (2 * 3 * 2 * 128 * 12 * 64 * 64 + 3 * 2 * 128 * 64 * 256) / 1e12
    assert tuned.compute == pytest.approx(base.compute - linear_s + linear_s / 2)
    assert plain.compute == pytest.approx(base.compute - linear_s + linear_s * 2)
    g = Gemm("fwd", "qkv", 1, 2, 3)
    assert cal.shape_tflops(g, tuned=True) is None  # not measured: the FLOP curve decides


def test_stream_exposure():
    assert stream_exposed([(4, 3.0, 1.0)]) == pytest.approx(pipelined_exposed(3.0, 1.0, 4))
    assert stream_exposed([(4, 0.5, 1.0)]) == 0.5
    # heavy chunks, then light ones: the heavy run's backlog drains behind the light
    # chunks' spare compute. Brute force: max over k of (comm from chunk k) - (compute
    # after chunk k) = 12 + 1 - 8 = 5 at k = 0.
    comm, compute = [3.0] * 4 + [0.2] * 5, [1.0] * 9
    suffixes = [sum(comm[k:]) - sum(compute[k + 1 :]) for k in range(9)]
    assert stream_exposed([(4, 3.0, 1.0), (5, 0.2, 1.0)]) == pytest.approx(max(suffixes)) == 5.0
    assert stream_exposed([(0, 5.0, 1.0)]) == 0.0


def test_compute_equals_model_flops_without_tensor_parallelism():
    for ckpt in (False, True):
        tr = train(activation_checkpointing=ckpt)
        st = step_time(hardware=HW, model=MODEL, train=tr, grid=Grid(data=2), calibration=EXACT)
        assert st.compute == pytest.approx(st.model_flops_per_gpu / 1e12, rel=1e-12)
        assert all(st.comm[a] == 0 for a in ("x", "y", "z", "xy"))


def test_elementwise_passes_per_token():
    h, f, v = 64, 256, 256
    per_layer, head = elementwise_elements(MODEL, Grid(data=2))
    # fused LayerNorms 2*2, residual adds 2*3 (x h); Q, K, V, output copies 4*2*h; GeLU 2*f
    assert per_layer == (4 + 6) * h + 8 * h + 2 * f and head == 6 * v
    per_layer, head = elementwise_elements(MODEL, Grid(x=2, y=2))
    # the x-exact LayerNorm takes 12 passes each; h/x, h/y, f/y, V/(x*y) per token
    assert per_layer == (24 + 6) * h / 2 + 8 * h / 2 + 2 * f / 2 and head == 6 * v / 4


def test_elementwise_time_hand_case_at_the_memory_bandwidth():
    # data=2, fp32 on a CPU-like profile at 1 GB/s: T = 4*32 = 128 tokens, one micro-step
    # (8 sequences / (4 * 2)); per layer forward 26h passes of 4 bytes, backward twice
    # that; the loss 6V passes of 4 bytes.
    hw = dataclasses.replace(HW, gpu_model="cpu", peak_tflops_per_gpu=1.0, memory_gbps=1.0)
    tr = train(dtype="fp32")
    with_bw = step_time(hardware=hw, model=MODEL, train=tr, grid=Grid(data=2), calibration=EXACT)
    plain = dataclasses.replace(hw, memory_gbps=0.0)
    without = step_time(hardware=plain, model=MODEL, train=tr, grid=Grid(data=2),
                        calibration=EXACT)  # fmt: skip
    t, h, v = 128, 64, 256
    per_micro = (2 * 3 * t * 26 * h * 4 + t * 6 * v * 4) / 1e9
    assert with_bw.accumulation == 1
    assert with_bw.compute - without.compute == pytest.approx(per_micro)
    measured = Calibration(gemm_efficiency=1.0, kernel_overhead_us=0.0,
                           elementwise=((1e3, 2.0), (1e9, 2.0)))  # fmt: skip
    faster = step_time(hardware=hw, model=MODEL, train=tr, grid=Grid(data=2), calibration=measured)
    assert faster.compute - without.compute == pytest.approx(per_micro / 2)  # measured wins


def test_compute_hand_case_with_attention_repeated_over_x():
    # l=2, h=64, s=32, V=256, T=4*32=128, x=2, no recompute (3 passes):
    # per micro-step 128*[2*3*(24*64^2/2 + 4*32*64) + 6*64*256/2] = 50,331,648 FLOPs;
    # global_batch 8 / micro_batch 4 = 2 micro-steps, at 1 TFLOP/s.
    st = step_time(hardware=HW, model=MODEL, train=train(), grid=Grid(x=2), calibration=EXACT)
    assert st.accumulation == 2
    assert st.compute == pytest.approx(2 * 50_331_648 / 1e12)


def test_data_parallel_all_reduce_hand_case():
    grid = Grid(data=8)  # spans two 4-GPU nodes: 4 per node -> min(100, 4*25) GB/s
    st = step_time(hardware=HW, model=MODEL, train=train(global_batch=32), grid=grid)
    nbytes = MODEL.n_params() * 4  # every fp32 gradient, one coalesced all-reduce
    assert local_param_elements(MODEL, grid) == MODEL.n_params()
    assert st.comm["data"] == pytest.approx(2 * 7 * 5e-6 + 2 * 7 / 8 * nbytes / 100e9)


def test_overlap_all_reduce_hides_the_backward_all_reduces_behind_slow_gemms():
    slow = dataclasses.replace(HW, peak_tflops_per_gpu=1e-6)  # GEMMs far longer than any AR
    no_alpha = dataclasses.replace(slow, latency_us=0.0)
    grid = Grid(y=2)
    on = step_time(hardware=no_alpha, model=MODEL, train=train(), grid=grid)
    off = step_time(hardware=no_alpha, model=MODEL, train=train(overlap=NO_OVERLAP), grid=grid)
    assert off.comm["y"] == off.comm_raw["y"] == on.comm_raw["y"]
    # y per layer: forward 2 ARs of T*h bf16, backward 2 dX ARs of T*h bf16 (the wire
    # dtype): the forward half stays exposed, the backward half hides behind the dW GEMMs.
    assert on.comm["y"] == pytest.approx(on.comm_raw["y"] / 2)
    fp32_dx = train(wire=WireConfig(all_reduce="fp32"))
    wide = step_time(hardware=no_alpha, model=MODEL, train=fp32_dx, grid=grid)
    assert wide.comm_raw["y"] == pytest.approx(on.comm_raw["y"] * 3 / 2)  # 2+4 bytes vs 2+2
    assert wide.comm["y"] == pytest.approx(wide.comm_raw["y"] / 3)


def test_overlaps_never_add_time_and_switching_them_off_exposes_everything():
    grid = Grid(data=2, x=2, y=2, z=4)
    for ckpt in (False, True):
        tr_on = train(global_batch=16, micro_batch=4, activation_checkpointing=ckpt)
        tr_off = dataclasses.replace(tr_on, overlap=NO_OVERLAP)
        on = step_time(hardware=HW, model=MODEL, train=tr_on, grid=grid)
        off = step_time(hardware=HW, model=MODEL, train=tr_off, grid=grid)
        assert off.comm == off.comm_raw
        assert on.comm_raw == pytest.approx(off.comm_raw)
        for axis, exposed in on.comm.items():
            assert exposed <= on.comm_raw[axis] + 1e-15
        assert on.comm["z"] < off.comm["z"] and on.total < off.total


def test_faster_network_or_lower_latency_never_slows_a_grid():
    tr = train(global_batch=32, micro_batch=4)
    fast = dataclasses.replace(HW, inter_node_gbps=50, latency_us=1)
    for grid in (Grid(data=8), Grid(data=2, x=2, y=2), Grid(x=2, z=4), Grid(y=4, z=2)):
        slow_t = step_time(hardware=HW, model=MODEL, train=tr, grid=grid).total
        fast_t = step_time(hardware=fast, model=MODEL, train=tr, grid=grid).total
        assert fast_t <= slow_t


@pytest.mark.parametrize(
    ("recompute", "flops_per_token"),
    [
        (False, 737_280),  # 72*l*h^2 * (1 + s/6h + V/12lh) = 589,824 * (1 + 1/12 + 1/6)
        (True, 950_272),  # 96*l*h^2 * (1 + s/6h + V/16lh) = 786,432 * (1 + 1/12 + 1/8)
    ],
)
def test_throughput_and_fraction_of_peak(recompute, flops_per_token):
    """MODEL (l=2, h=64, V=256) at s=32, computed by hand: 8 sequences of 32 tokens per
    step over 2 GPUs, and a 100 TFLOP/s peak."""
    hw = dataclasses.replace(HW, peak_tflops_per_gpu=100.0)
    tr = train(activation_checkpointing=recompute)
    st = step_time(hardware=hw, model=MODEL, train=tr, grid=Grid(data=2))
    flops_per_gpu = flops_per_token * 8 * 32 / 2
    assert st.model_flops_per_gpu == pytest.approx(flops_per_gpu)
    assert st.tflops_per_gpu == pytest.approx(flops_per_gpu / st.total / 1e12)
    assert st.fraction_of_peak == pytest.approx(flops_per_gpu / st.total / 1e12 / 100.0)
    assert 0 < st.fraction_of_peak < 1


# --------------------------------------------------------------------------- calibration


def test_calibration_layouts_cover_every_placement_once():
    from axonn_launch.calibrate import Layout, layouts

    found = {(lay.size, lay.per_node): lay.stride for lay in layouts(16, 4)}
    # 16 ranks, 4 per node: a group of p ranks `stride` apart needs p * stride <= 16
    assert found == {(2, 2): 1, (2, 1): 4, (4, 4): 1, (4, 2): 2, (4, 1): 4,
                     (8, 4): 1, (8, 2): 2, (16, 4): 1}  # fmt: skip
    assert Layout(size=2, stride=2, per_node=2).groups(8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert Layout(size=4, stride=1, per_node=4).groups(8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_timings_recover_the_ring_model():
    from axonn_launch.calibrate import fit_ring

    sizes = (1e5, 1e7, 1e8)
    for collective in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER):
        times = tuple(ring_time(collective, 8, m, 40.0, 7e-6) for m in sizes)
        bus, alpha = fit_ring(collective, 8, sizes, times)
        assert bus == pytest.approx(40.0) and alpha == pytest.approx(7.0)
    # a noisy point in the middle moves the least-squares line only a little
    times = [ring_time(ALL_REDUCE, 8, m, 40.0, 7e-6) for m in sizes]
    times[1] *= 1.2
    bus, _ = fit_ring(ALL_REDUCE, 8, sizes, tuple(times))
    assert 35 < bus < 45
    # no growth with size (noise): the largest message alone, no latency
    assert fit_ring(ALL_GATHER, 2, (1e3, 1e6), (1.0, 1.0)) == pytest.approx((0.5e-3, 0.0))


def test_calibrate_settings_from_the_command_line():
    from axonn_launch.calibrate import parse_args

    s = parse_args(["machine=frontier", "nproc=2", "output=x.json"])
    assert (s.machine, s.nproc, s.output_path().name) == ("frontier", 2, "x.json")
    assert parse_args(["machine=alps"]).output_path().name == "calibration-alps.json"
    assert parse_args(["block_seconds=0.2", "reps=3"]).block_seconds == 0.2
    with pytest.raises(ValueError, match="reps='many': expected int"):
        parse_args(["reps=many"])
    with pytest.raises(ValueError, match="expected key=value"):
        parse_args(["colour=red"])


@pytest.mark.slow
def check_calibration_feeds_the_planner(path: Path) -> None:
    """A local 2-rank calibration's file (the run: tests/journeys/test_first_hour.py::
    test_calibrate_reports_its_phases_and_writes_into_its_job_dir, one run for both) holds
    every measure and gives the planner a step time with a y-axis communication term."""
    raw = json.loads(path.read_text())
    assert raw["world_size"] == 2 and raw["backend"] == "gloo"
    cal = load_calibration(path)
    assert {c.collective for c in cal.collectives} == {ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER}
    assert all(c.size == 2 and c.per_node == 2 and c.bus_gbps > 0 for c in cal.collectives)
    assert len(cal.gemm) == 4 and all(rate > 0 for _, rate in cal.gemm)
    assert len(cal.elementwise) == 3 and all(gbps > 0 for _, gbps in cal.elementwise)
    overlap = raw["overlap"]
    assert 0.0 <= cal.overlap_efficiency == overlap["efficiency"] <= 1.0
    assert overlap["both_seconds"] > 0 and overlap["count"] >= 1 and overlap["size"] == 2
    cpu = Hardware(gpus_per_node=2)
    st = step_time(hardware=cpu, model=MODEL, train=train(), grid=Grid(y=2), calibration=cal)
    assert st.total > st.compute > 0 and st.comm["y"] > 0


# --------------------------------------------------------------------------- against the core


def _record_one_micro_step(rank: int, world: int, port: int, grid: dict, out: str) -> None:
    """One rank: a forward + backward of the training core's GPT, without and with
    activation checkpointing, with its collectives recorded; rank 0 writes the elements
    of block 0's Linears by "op:axis" as JSON."""
    import torch
    import torch.distributed as dist

    from axonn_launch.train.models.gpt import GPT
    from axonn_launch.train.parallel.groups import build_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        g = Grid(**grid)
        groups = build_groups(g, rank=rank)
        result = {}
        for ckpt in (False, True):
            model = GPT(MODEL, groups=groups, overlap=OverlapConfig(),
                        activation_checkpointing=ckpt)  # fmt: skip
            tokens = torch.randint(0, MODEL.vocab_size, (4 // g.z, 33))
            with model.comm.recording() as rec:
                model(tokens[:, :-1], tokens[:, 1:]).backward()
                model.runtime.flush_deferred_grads()
            totals: dict[str, int] = {}
            for r in rec.records:
                if r.tag.startswith(("blocks.0.attn.", "blocks.0.mlp.")):
                    totals[f"{r.op}:{r.axis}"] = totals.get(f"{r.op}:{r.axis}", 0) + r.numel
            result[str(ckpt)] = totals
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_volumes_match_what_the_training_core_sends(tmp_path):
    import socket

    import torch.multiprocessing as mp

    from tests.train.dist_utils import forkserver_context

    grid = Grid(x=2, y=2, z=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "records.json"
    forkserver_context()  # children fork from the server that has torch imported already
    args = (8, port, grid.as_dict(), str(out))
    mp.start_processes(_record_one_micro_step, args=args, nprocs=8, start_method="forkserver")
    recorded = json.loads(out.read_text())
    for ckpt in (False, True):
        tr = train(micro_batch=4, activation_checkpointing=ckpt)
        expected: dict[str, float] = {}
        for c in block_collectives(MODEL, grid, tr, on_gpu=False):
            if c.linear != NORM:  # the LayerNorms' statistics carry other tags
                expected[f"{c.op}:{c.axis}"] = expected.get(f"{c.op}:{c.axis}", 0) + c.elements
        assert recorded[str(ckpt)] == expected


def test_calibrate_times_the_gemm_shapes_of_the_planned_grids():
    from axonn_launch.calibrate import Settings, gemm_shapes_to_measure
    from axonn_launch.config.compose import load
    from axonn_launch.cost.perf import planned_gemms
    from axonn_launch.cost.planner import plan

    settings = Settings(machine="perlmutter", model="gpt_5b", nodes=16, gemm_grids=2)
    shapes, planned = gemm_shapes_to_measure(settings, world=8, gpus_per_node=4)
    cfg = load(["machine=perlmutter", "model=gpt_5b"])
    rows = plan(machine=cfg.machine, model=cfg.model, train=cfg.train, nodes=16, top=2)
    expected = set()
    for r in rows:
        tr = dataclasses.replace(cfg.train, micro_batch=r.micro_batch)
        expected |= {g.key for g in planned_gemms(cfg.model, r.grid, tr)}
    assert {g.key for g in shapes} == expected and len(shapes) == len(expected)
    assert planned.startswith("16 node(s): (") and rows[0].grid.describe() in planned
    assert gemm_shapes_to_measure(Settings(), world=2, gpus_per_node=2) == ([], "")


def test_gemm_operands_are_laid_out_as_the_core_passes_them():
    import torch

    from axonn_launch.train.health.calibrate import gemm_operands

    cpu = torch.device("cpu")
    a, b = gemm_operands(Gemm("fwd", "qkv", 8, 6, 4), cpu)  # X @ W^T
    assert a.shape == (8, 4) and a.is_contiguous() and b.shape == (4, 6) and b.t().is_contiguous()
    a, b = gemm_operands(Gemm("dx", "qkv", 8, 4, 6), cpu)  # dY @ W
    assert a.is_contiguous() and b.is_contiguous() and b.shape == (6, 4)
    a, b = gemm_operands(Gemm("dw", "qkv", 6, 4, 8), cpu)  # dY^T @ X
    assert a.shape == (6, 8) and a.t().is_contiguous() and b.shape == (8, 4) and b.is_contiguous()
