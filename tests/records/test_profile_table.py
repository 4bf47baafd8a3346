"""``report``'s profile table from traces written here as torch.profiler writes them (Chrome
trace events, microseconds): the GPU case, which this machine cannot profile, and the
nesting rule. A real 4-rank CPU window is read in tests/train/test_loop.py."""

from __future__ import annotations

import pytest

from axonn_launch.records.profile import profile_rows, rank_profile, self_times, union_s


def event(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": tid}


def test_overlapping_intervals_count_once():
    assert union_s([(0, 10), (5, 15), (20, 30)]) == pytest.approx(25e-6)


def test_a_wrapper_op_does_not_count_its_children_again():
    found = self_times(
        [event("outer", 0, 100), event("aten::mm", 10, 60), event("other", 0, 5, tid=2)]
    )
    assert found["outer"] == pytest.approx(40e-6) and found["aten::mm"] == pytest.approx(60e-6)


def test_on_gpus_nccl_kernels_are_the_collectives_and_the_rest_is_compute():
    trace = {"traceEvents": [
        event("aten::mm", 0, 400),
        event("sm90_xmma_gemm", 100, 300, cat="kernel"),
        event("ncclDevKernel_AllReduce_Sum_bf16", 350, 200, cat="kernel", tid=7),  # own stream
        event("ncclDevKernel_ReduceScatter_Sum_bf16", 600, 100, cat="kernel", tid=7),
    ]}  # fmt: skip
    found = rank_profile(3, trace, top=2)
    assert found.on_gpu and found.window_s == pytest.approx(700e-6)
    assert found.comm_s == pytest.approx(300e-6) and found.compute_s == pytest.approx(300e-6)
    assert [name for name, _ in found.top] == ["sm90_xmma_gemm", "ncclDevKernel_AllReduce_Sum_bf16"]
    (row,) = profile_rows([found])
    assert row[:5] == ("3", "0.001", "0.000", "43%", "0.000")
