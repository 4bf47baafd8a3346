"""The GEMM layout tuner: equivalent formulations, one pick per signature, autocast dtypes."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.train import run_job
from axonn_launch.train.loop import average_loss_and_flags, gather_gemm_choices
from axonn_launch.train.metrics import MetricsLogger, StepStats
from axonn_launch.train.parallel.gemm import (
    FORMULATIONS,
    GemmTuner,
    distinct_formulations,
    layout,
    time_formulations,
)
from axonn_launch.train.parallel.groups import build_groups
from tests.train.dist_utils import run_world
from tests.train.test_loop import launch, metrics, single_env, write_job

M, K, N = 96, 40, 72  # tokens, in features, out features: nothing square


def tp_linear_gemms(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The three GEMMs of a Linear as TPLinear calls them: fwd X Wᵀ, dx dY W, dw dYᵀ X."""
    gen = torch.Generator().manual_seed(seed)
    x, w, dy = (torch.randn(*shape, generator=gen) for shape in ((M, K), (N, K), (M, N)))
    return {"fwd": (x, w.t()), "dx": (dy, w), "dw": (dy.t(), x)}


def strided_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """A left operand that is neither row- nor column-major (every other column)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(M, 2 * K, generator=gen)[:, ::2], torch.randn(K, N, generator=gen)


def all_pairs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {**tp_linear_gemms(), "strided": strided_pair()}


def test_layouts_of_the_operands():
    gemms = tp_linear_gemms()
    assert [layout(t) for t in gemms["fwd"]] == ["row", "col"]
    assert [layout(t) for t in gemms["dw"]] == ["col", "row"]
    assert layout(strided_pair()[0]) == "strided"


@pytest.mark.parametrize("shape", [(1, 5), (5, 1), (1, 1), (3, 4)])
def test_layout_agrees_with_is_contiguous_for_size_one_dims(shape):
    t = torch.randn(*shape)
    for view in (t, t.t(), torch.randn(shape[0], 2 * shape[1])[:, ::2]):
        row, col = view.is_contiguous(), view.t().is_contiguous()
        assert layout(view) == ("row" if row else "col" if col else "strided")


@pytest.mark.parametrize("op", ["fwd", "dx", "dw", "strided"])
@pytest.mark.parametrize("name", list(FORMULATIONS))
def test_every_formulation_equals_a_at_b(op, name):
    a, b = all_pairs()[op]
    got = FORMULATIONS[name](a, b)
    assert got.shape == (a.shape[0], b.shape[1]) and got.dtype == torch.float32
    assert got.is_contiguous()  # callers all-reduce and view it
    torch.testing.assert_close(got, a @ b, rtol=1e-5, atol=1e-5)


def test_formulations_cover_axonns_eight():
    assert len(FORMULATIONS) == 8
    assert sum(f.transposed for f in FORMULATIONS.values()) == 4
    assert {(f.lhs, f.rhs) for f in FORMULATIONS.values()} == {
        ("given", "given"), ("row", "row"), ("col", "given"), ("given", "col"),
    }  # fmt: skip


def test_equivalent_formulations_are_timed_once():
    x, wt = tp_linear_gemms()["fwd"]  # wt is column-major already: storing it so is a no-op
    names = distinct_formulations(x, wt)
    assert names[0] == "direct"
    assert "direct_rhs_col" not in names and "direct_contiguous" in names
    # both operands row-major: "direct_contiguous" copies nothing, so it is "direct"
    assert "direct_contiguous" not in distinct_formulations(x.contiguous(), wt.contiguous())
    strided = distinct_formulations(*strided_pair())
    assert {"direct", "direct_contiguous", "direct_lhs_col"} <= set(strided)


def test_gradients_through_a_formulation_match():
    gemms = tp_linear_gemms()
    a, b = (t.detach().clone().requires_grad_() for t in gemms["dw"])
    FORMULATIONS["transposed_contiguous"](a, b).sum().backward()
    a0, b0 = (t.detach().clone().requires_grad_() for t in gemms["dw"])
    (a0 @ b0).sum().backward()
    torch.testing.assert_close(a.grad, a0.grad)
    torch.testing.assert_close(b.grad, b0.grad)


def test_time_formulations_times_each_name():
    a, b = tp_linear_gemms()["dx"]
    seconds = time_formulations(a, b, reps=2, warmup=1)
    assert set(seconds) == set(FORMULATIONS) and all(s > 0 for s in seconds.values())
    assert set(time_formulations(a, b, 1, names=["transposed"])) == {"transposed"}
    with pytest.raises(ValueError, match="reps"):
        time_formulations(a, b, reps=0)


# ---------------------------------------------------------------------------------------
# The tuner


def test_tuner_picks_once_per_signature_and_reuses_it():
    tuner = GemmTuner(min_flops=0, warmup=1, reps=2)
    gemms = tp_linear_gemms()
    for op, (a, b) in gemms.items():
        torch.testing.assert_close(tuner.mm(op, a, b), a @ b, rtol=1e-5, atol=1e-5)
    picks = tuner.choices()
    assert len(picks) == 3 and set(picks.values()) <= set(FORMULATIONS)
    assert tuner.tunings == 3
    calls = tuner.timed_calls
    expected = sum(len(distinct_formulations(a, b)) for a, b in gemms.values()) * (1 + 2)
    assert calls == expected
    for _ in range(3):
        for op, (a, b) in tp_linear_gemms(seed=5).items():  # new values, same signatures
            torch.testing.assert_close(tuner.mm(op, a, b), a @ b, rtol=1e-5, atol=1e-5)
    assert tuner.tunings == 3 and tuner.timed_calls == calls and tuner.choices() == picks


def test_a_new_layout_dtype_or_op_is_a_new_signature():
    tuner = GemmTuner(min_flops=0, warmup=0, reps=1)
    x, wt = tp_linear_gemms()["fwd"]
    tuner.mm("fwd", x, wt)
    tuner.mm("fwd", x, wt.contiguous())  # same shapes, the weight stored row-major
    tuner.mm("fwd", x.double(), wt.double())
    tuner.mm("other", x, wt)
    keys = list(tuner.choices())
    assert tuner.tunings == 4 and len(keys) == 4
    assert keys[0] == "fwd 96x40 row float32 @ 40x72 col float32 cpu"
    assert keys[1] == "fwd 96x40 row float32 @ 40x72 row float32 cpu"


def test_new_picks_are_taken_once():
    tuner = GemmTuner(min_flops=0, warmup=0, reps=1)
    a, b = tp_linear_gemms()["dw"]
    assert not tuner.has_new and tuner.take_new() == {}
    tuner.mm("dw", a, b)
    assert tuner.has_new
    new = tuner.take_new()
    assert new == tuner.choices() and not tuner.has_new and tuner.take_new() == {}
    tuner.mm("dw", a, b)
    assert not tuner.has_new


def test_disabled_tuner_times_nothing():
    tuner = GemmTuner(enabled=False, min_flops=0)
    for op, (a, b) in tp_linear_gemms().items():
        assert torch.equal(tuner.mm(op, a, b), a @ b)
    assert tuner.tunings == 0 and tuner.timed_calls == 0 and tuner.choices() == {}


def test_small_gemms_are_not_tuned():
    tuner = GemmTuner()  # default threshold: 1 MFLOP; these are 2*96*40*72 = 0.55 MFLOP
    with capture_log() as lines:
        for op, (a, b) in tp_linear_gemms().items():
            assert torch.equal(tuner.mm(op, a, b), a @ b)
    assert tuner.tunings == 0 and tuner.choices() == {}
    assert len(lines) == 1 and "untuned" in lines[0]  # said once, not per signature
    big = torch.randn(128, 128), torch.randn(128, 128)  # 4.2 MFLOP
    tuner.mm("fwd", *big)
    assert tuner.tunings == 1


def test_signature_budget_bounds_tuning():
    tuner = GemmTuner(min_flops=0, warmup=0, reps=1, max_signatures=2)
    gemms = tp_linear_gemms()
    with capture_log() as lines:
        for op, (a, b) in gemms.items():
            tuner.mm(op, a, b)
    assert tuner.tunings == 2 and len(tuner.choices()) == 2
    assert sum("budget" in line for line in lines) == 1
    a, b = gemms["dw"]
    assert torch.equal(tuner.mm("dw", a, b), a @ b)  # the third runs as given
    assert tuner.tunings == 2


def test_each_pick_is_logged_with_its_timings():
    tuner = GemmTuner(min_flops=0, warmup=0, reps=1)
    a, b = tp_linear_gemms()["dx"]
    with capture_log() as lines:
        tuner.mm("dx", a, b)
        tuner.mm("dx", a, b)
    assert len(lines) == 1
    (pick,) = tuner.choices().values()
    assert lines[0].startswith("gemm dx 96x72 row float32 @ 72x40 row float32 cpu")
    assert f"picked {pick};" in lines[0]
    assert all(name in lines[0] for name in distinct_formulations(a, b))


# ---------------------------------------------------------------------------------------
# Autocast: the same compute dtype as a @ b


@pytest.mark.parametrize("name", list(FORMULATIONS))
def test_formulations_under_bf16_autocast_compute_in_bf16(name):
    a, b = tp_linear_gemms()["fwd"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = a @ b
        got = FORMULATIONS[name](a, b)
    assert expected.dtype == got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    assert not torch.equal(got, (a @ b).bfloat16())  # bf16 operands, not a cast fp32 result


def test_float64_is_not_cast_under_autocast_as_a_at_b():
    a, b = (t.double() for t in tp_linear_gemms()["dx"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = a @ b
        got = FORMULATIONS["transposed_lhs_col"](a, b)
    assert expected.dtype == got.dtype == torch.float64


def test_tuner_under_autocast_keeps_a_separate_pick_and_the_dtype():
    tuner = GemmTuner(min_flops=0, warmup=0, reps=1)
    for op, (a, b) in tp_linear_gemms().items():
        assert tuner.mm(op, a, b).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert tuner.mm(op, a, b).dtype == (a @ b).dtype == torch.bfloat16
    keys = list(tuner.choices())
    assert len(keys) == 6 and sum(key.endswith("autocast bfloat16") for key in keys) == 3


# ---------------------------------------------------------------------------------------
# Recording the picks: the loop's gather over ranks, the metrics rows and summary


def _tune_on_rank_one(rank: int, world_size: int) -> tuple:
    """Only rank 1 tunes a GEMM; every rank must learn that and get its picks."""
    tuner = GemmTuner(min_flops=0, warmup=0, reps=1)
    if rank == 1:
        tuner.mm("dw", *tp_linear_gemms()["dw"])
    share = torch.tensor(float(rank))  # each rank's share of the step's loss
    groups = build_groups(Grid(data=world_size), rank=rank)
    mean, (stop, new) = average_loss_and_flags(
        share, (False, tuner.has_new), torch.device("cpu"), groups
    )
    gathered = gather_gemm_choices(tuner) if new else None
    return mean, stop, new, gathered, tuner.has_new


@pytest.mark.slow
def test_any_ranks_new_picks_are_gathered_on_every_rank():
    results = run_world(_tune_on_rank_one, 2, timeout=120)
    picks = results[1][3]["1"]
    assert len(picks) == 1 and next(iter(picks)).startswith("dw 72x96 col float32")
    for mean, stop, new, gathered, still_new in results:
        assert mean == 1.0 and not stop and new and not still_new  # 0 + 1
        assert gathered == {"1": picks}  # rank 0 had none: not listed


def test_single_process_gather():
    tuner = GemmTuner(min_flops=0, warmup=0, reps=1)
    assert gather_gemm_choices(tuner) == {} and gather_gemm_choices(None) == {}
    tuner.mm("fwd", *tp_linear_gemms()["fwd"])
    assert gather_gemm_choices(tuner) == {"0": tuner.choices()}
    assert gather_gemm_choices(tuner) == {}  # taken


def test_metrics_row_tallies_new_picks_and_summary_keeps_all(tmp_path):
    logger = MetricsLogger(
        job_dir=tmp_path,
        model=ModelSpec("m", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=64),
        seq_len=64, recompute=False, world_size=2, peak_tflops_per_gpu=0.0, total_steps=3,
        device=torch.device("cpu"), enabled=True, progress=False, stream=io.StringIO(),
    )  # fmt: skip
    stats = StepStats(step=1, loss=2.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1, tokens=64)
    first = {"0": {"fwd A": "direct", "dx B": "transposed"}, "1": {"fwd A": "direct"}}
    with capture_log("axonn_launch.train.metrics") as lines:
        logger.add_gemm_choices(first, step=1)
    assert lines == [
        "gemm tuning in step 1: 2 signatures on 2 ranks, picks: direct 2, transposed 1 "
        "(each rank's in logs/rank_<N>.log)"
    ]
    logger.record(stats)
    logger.record(StepStats(**{**stats.__dict__, "step": 2}))
    logger.add_gemm_choices({"1": {"dx B": "direct_contiguous"}}, step=3)
    logger.record(StepStats(**{**stats.__dict__, "step": 3}))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["gemm_choices"] == {"fwd A": {"direct": 2}, "dx B": {"transposed": 1}}
    assert "gemm_choices" not in rows[1]
    assert rows[2]["gemm_choices"] == {"dx B": {"direct_contiguous": 1}}
    assert logger.gemm_choices == {
        "0": {"fwd A": "direct", "dx B": "transposed"},
        "1": {"fwd A": "direct", "dx B": "direct_contiguous"},
    }


# ---------------------------------------------------------------------------------------
# Training runs with gemm_tuning on and off


def picked_lines(job_dir, rank: int) -> list[str]:
    text = (job_dir / "logs" / f"rank_{rank}.log").read_text()
    return [line for line in text.splitlines() if "axonn_launch.train.parallel.gemm: gemm " in line]


def check_tuned_run(job_dir, ranks: int) -> dict:
    """The picks of a tuned run are in every rank's log, the summary and step 1's row."""
    summary = json.loads((job_dir / "summary.json").read_text())
    choices = summary["gemm_choices"]
    assert sorted(choices, key=int) == [str(r) for r in range(ranks)]
    for rank, picks in choices.items():
        assert picks and set(picks.values()) <= set(FORMULATIONS)
        lines = picked_lines(job_dir, int(rank))
        assert len(lines) == len(picks)  # one line per tuned signature, none repeated
        for sig, name in picks.items():
            assert sum(f"gemm {sig} (" in line and f"picked {name};" in line for line in lines) == 1
    rows = metrics(job_dir)
    tally = rows[0]["gemm_choices"]
    assert sum(n for counts in tally.values() for n in counts.values()) == sum(
        len(picks) for picks in choices.values()
    )
    assert all("gemm_choices" not in row for row in rows[1:])  # tuned in the first step only
    assert f"on {ranks} ranks, picks:" in (job_dir / "logs" / "rank_0.log").read_text()
    return summary


def check_untuned_run(job_dir, ranks: int) -> None:
    assert json.loads((job_dir / "summary.json").read_text())["gemm_choices"] == {}
    assert all("gemm_choices" not in row for row in metrics(job_dir))
    assert all(picked_lines(job_dir, rank) == [] for rank in range(ranks))


def assert_same_losses(tuned, untuned) -> None:
    a, b = metrics(tuned), metrics(untuned)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=0)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4, abs=0)


def test_one_rank_run_with_and_without_tuning(tmp_path):
    tuned, untuned = tmp_path / "tuned", tmp_path / "untuned"
    for job, on in ((tuned, True), (untuned, False)):
        spec = write_job(job, Grid(), steps=6, warmup_steps=2, data="synthetic", gemm_tuning=on)
        run_job(spec, env=single_env())
    check_tuned_run(tuned, 1)
    check_untuned_run(untuned, 1)
    assert_same_losses(tuned, untuned)


@pytest.mark.slow
def test_four_rank_grid_with_and_without_tuning(tmp_path):
    grid = Grid(x=2, z=2)
    tuned, untuned = tmp_path / "tuned", tmp_path / "untuned"
    for job, on in ((tuned, True), (untuned, False)):
        write_job(job, grid, steps=6, warmup_steps=2, micro_batch=8, data="synthetic",
                  gemm_tuning=on)  # fmt: skip
        launch(job, 4, "axonn_launch.train")
    check_tuned_run(tuned, 4)
    check_untuned_run(untuned, 4)
    assert_same_losses(tuned, untuned)


class capture_log:
    """Collects the messages of a logger (the job's logging setup stops the
    ``axonn_launch`` records from propagating, so pytest's caplog may not see them)."""

    def __init__(
        self, name: str = "axonn_launch.train.parallel.gemm", level: int = logging.DEBUG
    ) -> None:
        self.name, self.level_wanted = name, level

    def __enter__(self) -> list[str]:
        self.lines: list[str] = []
        self.logger = logging.getLogger(self.name)
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        self.level = self.logger.level
        self.logger.setLevel(self.level_wanted)
        self.logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *_: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
