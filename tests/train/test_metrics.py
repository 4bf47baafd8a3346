"""Metrics rows: throughput from the Narayanan FLOP count, MFU, rank-0-only writing."""

from __future__ import annotations

import dataclasses
import io
import json
import logging

import pytest
import torch

from axonn_launch.common.models import ModelSpec
from axonn_launch.train.metrics import (
    MetricsLogger,
    StepStats,
    format_duration,
    progress_line,
    status_line,
    summary_line,
)

MODEL = ModelSpec("m", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=64)
STATS = StepStats(step=3, loss=2.5, lr=1e-3, grad_norm=0.7, step_time_s=0.5, tokens=1024)


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def make_logger(
    tmp_path, *, enabled=True, recompute=False, peak=0.0, stream=None, log_every_s=30.0
):
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
        log_every_s=log_every_s,
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


SUMMARY = {
    "steps": 200,
    "final_loss": 1.5,
    "tokens_per_s": 9000.0,
    "tflops_per_gpu": 0.02,
    "mfu": None,
    "elapsed_s": 41.0,
    "stopped": False,
}


def test_summary_line():
    summary = dict(SUMMARY)
    assert summary_line(summary) == (
        "done: 200 steps, final loss 1.5000, 9000 tok/s, 0.02 TFLOP/s/gpu, 41.0s"
    )
    assert summary_line({**summary, "val_loss": 1.625}, per="rank") == (
        "done: 200 steps, final loss 1.5000, val loss 1.6250, 9000 tok/s, 0.02 TFLOP/s/rank, 41.0s"
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


def steps(logger, numbers, clock, monkeypatch, seconds_apart):
    """Record ``numbers`` as steps ``seconds_apart`` seconds apart on a fake clock."""
    for n in numbers:
        clock[0] += seconds_apart
        logger.record(dataclasses.replace(STATS, step=n))


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("axonn_launch.train.metrics.time.perf_counter", lambda: now[0])
    return now


def test_off_a_terminal_a_line_every_log_every_s_and_at_the_last_step(
    tmp_path, clock, monkeypatch, caplog
):
    """A Slurm log or a pipe gets progress lines, not silence until the end."""
    stream = io.StringIO()
    logger = make_logger(tmp_path, stream=stream, log_every_s=10.0)
    with caplog.at_level(logging.INFO, logger="axonn_launch.train.metrics"):
        steps(logger, range(1, 11), clock, monkeypatch, seconds_apart=4.0)
    lines = [r.getMessage() for r in caplog.records]
    # steps at 4 s apart, a line at most every 10 s: steps 1, 4, 7 and the last, 10
    assert [line.split()[1] for line in lines] == ["1/10", "4/10", "7/10", "10/10"]
    assert lines[1] == "step 4/10 loss 2.5000 | 2048 tok/s 0.5 s/step | 16s elapsed, eta 24s"
    assert lines[-1].endswith("eta 0s")
    assert stream.getvalue() == ""  # no bar control codes in a log


def test_log_every_s_zero_logs_every_step(tmp_path, clock, monkeypatch, caplog):
    logger = make_logger(tmp_path, log_every_s=0.0)
    with caplog.at_level(logging.INFO, logger="axonn_launch.train.metrics"):
        steps(logger, range(1, 6), clock, monkeypatch, seconds_apart=0.0)
    assert len(caplog.records) == 5


def test_the_bar_ends_its_line_at_the_last_step_and_when_closed_early(tmp_path):
    tty = TtyStream()
    logger = make_logger(tmp_path / "a", stream=tty)
    for n in (9, 10):
        logger.record(dataclasses.replace(STATS, step=n))
    assert tty.getvalue().endswith("\n") and tty.getvalue().count("\n") == 1
    logger.finish({**SUMMARY})
    assert tty.getvalue().count("\n") == 1  # finish adds no blank line
    early = TtyStream()
    stopped = make_logger(tmp_path / "b", stream=early)
    stopped.record(STATS)
    stopped.close_bar()  # before a sample or a stop message prints
    stopped.close_bar()
    assert early.getvalue().endswith("\n") and early.getvalue().count("\n") == 1


def test_status_line_counts_the_eta_from_where_a_resumed_run_started():
    row = {"step": 60, "loss": 1.0, "tokens_per_s": 100.0, "step_time_s": 1.0, "elapsed_s": 10.0}
    # resumed from step 50: 10 steps in 10 s, 40 to go
    assert status_line(row, 100, first_step=50).endswith("10s elapsed, eta 40s")
    assert format_duration(3725) == "1h02m" and format_duration(75) == "1m15s"
    assert format_duration(float("nan")) == "-"


def terminal_shows(written: str) -> str:
    """What a terminal's current line shows after ``written``: a carriage return moves
    to column 0, ESC[K erases from the cursor to the end of the line."""
    line: list[str] = []
    col = 0
    for ch in written.replace("\x1b[K", "\0"):
        if ch == "\r":
            col = 0
        elif ch == "\0":
            del line[col:]
        else:
            line[col : col + 1] = [ch]
            col += 1
    return "".join(line)


def test_a_shorter_bar_leaves_nothing_of_the_longer_one(tmp_path, clock):
    """The ETA shrinks (``eta 6m45s``, then ``eta 5s``): without erasing, the longer
    line's tail would stay on screen (the ``45ss`` a user saw)."""
    tty = TtyStream()
    logger = make_logger(tmp_path, stream=tty)
    clock[0] += 45.0
    logger.record(dataclasses.replace(STATS, step=1))  # 45 s per step, 9 to go
    logger.record(dataclasses.replace(STATS, step=9))  # 5 s per step, 1 to go
    shown = terminal_shows(tty.getvalue())
    assert shown == progress_line(logger.last, 10, first_step=0, per="rank")
    assert shown.endswith(" TFLOP/s/rank 45s, eta 5s")


def test_the_bar_says_per_gpu_only_on_a_gpu():
    row = {"step": 5, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "tflops_per_gpu": 0.5,
           "elapsed_s": 20.0}  # fmt: skip
    assert "0.5 TFLOP/s/gpu 20s, eta 20s" in progress_line(row, 10, per="gpu")
    # resumed at step 4: one step in 20 s, five to go
    assert progress_line(row, 10, first_step=4, per="rank").endswith("TFLOP/s/rank 20s, eta 1m40s")
