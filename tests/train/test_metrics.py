"""Metrics rows: throughput from the Narayanan FLOP count, MFU, rank-0-only writing."""

from __future__ import annotations

import io
import json

import pytest
import torch

from axonn_launch.models import ModelSpec
from axonn_launch.train.metrics import MetricsLogger, StepStats, progress_line, summary_line

MODEL = ModelSpec("m", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=64)
STATS = StepStats(step=3, loss=2.5, lr=1e-3, grad_norm=0.7, step_time_s=0.5, tokens=1024)


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def make_logger(tmp_path, *, enabled=True, recompute=False, peak=0.0, stream=None):
    return MetricsLogger(
        job_dir=tmp_path,
        model=MODEL,
        seq_len=64,
        recompute=recompute,
        world_size=4,
        peak_tflops_per_gpu=peak,
        total_steps=10,
        device=torch.device("cpu"),
        enabled=enabled,
        progress=True,
        stream=stream or io.StringIO(),
    )


@pytest.mark.parametrize("recompute", [False, True])
def test_row_fields_and_tflops(tmp_path, recompute):
    row = make_logger(tmp_path, recompute=recompute, peak=0.001).record(STATS)
    layers, h, s, v = 2, 64, 64, 256
    if recompute:
        flops = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    else:
        flops = 72 * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert row["tokens_per_s"] == pytest.approx(2048)
    assert row["tflops_per_gpu"] == pytest.approx(flops * 1024 / 0.5 / 4 / 1e12)
    assert row["mfu"] == pytest.approx(row["tflops_per_gpu"] / 0.001)
    assert row["mem_gb"] > 0.01  # the test process's peak RSS, far above 10 MiB
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert written == row
    assert {"step", "loss", "lr", "grad_norm", "elapsed_s"} <= set(written)


def test_mfu_is_null_without_a_peak(tmp_path):
    assert make_logger(tmp_path).record(STATS)["mfu"] is None


def test_only_the_enabled_rank_writes(tmp_path):
    stream = TtyStream()
    make_logger(tmp_path, enabled=False, stream=stream).record(STATS)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert stream.getvalue() == ""


def test_progress_line_only_on_a_terminal(tmp_path):
    plain, tty = io.StringIO(), TtyStream()
    make_logger(tmp_path / "a", stream=plain).record(STATS)
    make_logger(tmp_path / "b", stream=tty).record(STATS)
    assert plain.getvalue() == ""
    assert tty.getvalue().startswith("\r[######..............] 3/10 loss 2.5000")
    assert "\n" not in tty.getvalue()


def test_summary_line():
    summary = {
        "steps": 200,
        "final_loss": 1.5,
        "tokens_per_s": 9000.0,
        "tflops_per_gpu": 0.02,
        "mfu": None,
        "elapsed_s": 41.0,
        "stopped": False,
    }
    assert summary_line(summary) == (
        "done: 200 steps, final loss 1.5000, 9000 tok/s, 0.02 TFLOP/s/gpu, 41.0s"
    )
    assert "mfu 50.0%" in summary_line({**summary, "mfu": 0.5})
    assert progress_line(
        {
            "step": 10,
            "loss": 1.0,
            "lr": 1e-3,
            "tokens_per_s": 1.0,
            "tflops_per_gpu": 0.1,
            "elapsed_s": 2.0,
        },
        10,
    ).startswith("[" + "#" * 20)
