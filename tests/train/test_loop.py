"""The training loop: schedule and optimizer units, a 4-rank run whose loss falls, resume."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import JobSpec, OverlapConfig, RuntimeConfig, TrainConfig
from axonn_launch.common.tracking import ProfileConfig
from axonn_launch.records.profile import read_profiles
from axonn_launch.scheduler.processes import WarmStart, free_port, rank_env
from axonn_launch.train import run_job
from axonn_launch.train.loop import learning_rate
from axonn_launch.train.models.gpt import GPT
from axonn_launch.train.models.optim import build_optimizer, compute_dtype, is_matrix
from axonn_launch.train.parallel.bootstrap import DistEnv
from axonn_launch.train.parallel.groups import single_process_groups

REPO = Path(__file__).resolve().parents[2]
TINY = ModelSpec("gpt_tiny", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=64)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_warmup_then_cosine_to_min_lr():
    train = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    lrs = [learning_rate(s, train) for s in range(101)]
    assert lrs[0] == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak
    assert lrs[9] == pytest.approx(1e-3)
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[55] == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway through the decay
    assert lrs[100] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))


def test_constant_schedule_after_warmup():
    train = TrainConfig(steps=50, warmup_steps=5, lr=2e-3, schedule="constant")
    assert learning_rate(2, train) == pytest.approx(2e-3 * 3 / 5)
    assert {learning_rate(s, train) for s in range(5, 50)} == {2e-3}


def test_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match="schedule"):
        learning_rate(10, TrainConfig(schedule="linear", warmup_steps=2))


def test_compute_dtype():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert compute_dtype(TrainConfig(), cpu) == torch.float32
    assert compute_dtype(TrainConfig(), gpu) == torch.bfloat16
    assert compute_dtype(TrainConfig(dtype="bf16"), cpu) == torch.bfloat16
    with pytest.raises(ValueError):
        compute_dtype(TrainConfig(dtype="fp16"), cpu)


def test_weight_decay_applies_to_matrices_only():
    model = GPT(TINY, groups=single_process_groups(), overlap=OverlapConfig(), seed=0)
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    h, layers = TINY.d_model, TINY.n_layer
    matrices = layers * 12 * h * h + TINY.vocab_size * h + TINY.max_seq_len * h
    assert sum(p.numel() for p in decay["params"]) == matrices
    assert sum(p.numel() for p in no_decay["params"]) == TINY.n_params() - matrices
    assert all(is_matrix(p) for p in decay["params"])


# ---------------------------------------------------------------------------------------
# Multi-process runs: one process per rank, started the way the local launcher does


def write_job(job_dir: Path, grid: Grid, **train) -> JobSpec:
    base = TrainConfig(steps=12, warmup_steps=4, global_batch=16, micro_batch=4, seq_len=64)
    spec = JobSpec(
        name="test",
        job_dir=str(job_dir),
        model=TINY,
        grid=grid,
        train=replace(base, **train),
        runtime=RuntimeConfig(device="cpu"),
    )
    job_dir.mkdir(parents=True, exist_ok=True)
    spec.save(job_dir / "spec.json")
    return spec


def launch(job_dir: Path, world_size: int, module: str, *args: str) -> list[str]:
    """Run all ranks of ``python -m module job_dir args...`` to completion; returns each
    rank's stdout. The ranks fork from the launcher's warm start (``scheduler/processes.py``),
    which imports torch once for them all, as a local job's ranks do."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    base["PYTHONPATH"] = str(REPO)
    envs = [
        rank_env(rank=r, world_size=world_size, port=port, base=base) for r in range(world_size)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        logs = [(Path(tmp) / f"{r}.out", Path(tmp) / f"{r}.err") for r in range(world_size)]
        warm = WarmStart(job_dir, env=base, cwd=REPO)
        ranks = warm.start([module, str(job_dir), *args], envs, logs)
        assert ranks is not None, "the warm start could not start the ranks"
        codes = [rank.wait(timeout=600) for rank in ranks]
        warm.close()
        outputs = [out.read_text() if out.exists() else "" for out, _ in logs]
        errors = [err.read_text() if err.exists() else "" for _, err in logs]
    for rank, code in enumerate(codes):
        assert code == 0, f"rank {rank} failed:\n{errors[rank][-4000:]}"
    return outputs


def metrics(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_four_ranks_on_shakespeare_loss_falls(tmp_path):
    job = tmp_path / "job"
    write_job(job, Grid(x=2, z=2), steps=60, warmup_steps=10, micro_batch=16, sample_tokens=20,
              profile=ProfileConfig(steps="3-4", memory=True))  # fmt: skip
    outputs = launch(job, 4, "axonn_launch.train")
    rows = metrics(job)
    assert [r["step"] for r in rows] == list(range(1, 61))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert first == pytest.approx(math.log(256), abs=0.3)  # a fresh model is near uniform
    assert last < 3.2, f"loss only fell from {first:.3f} to {last:.3f}"
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["tflops_per_gpu"] > 0 and row["mem_gb"] > 0
        assert row["mfu"] is None and math.isfinite(row["grad_norm"])
    summary = json.loads((job / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["final_loss"] == rows[-1]["loss"]
    assert len(summary["sample"]) == 21  # the one-byte prompt and 20 new bytes
    assert "--- sample" in outputs[0] and "--- sample" not in outputs[1]
    assert (job / "checkpoints" / "latest").read_text() == "step_00000060"
    for rank in range(4):  # train.profile.steps=3-4: a Chrome trace per rank, collectives in it
        trace = json.loads((job / "profile" / f"trace_rank{rank}.json").read_text())
        ops = [event.get("name") for event in trace["traceEvents"] if event.get("ph") == "X"]
        collectives = {"c10d::allreduce_", "c10d::_reduce_scatter_base_", "c10d::_allgather_base_"}
        assert collectives <= set(ops)
        assert ops.count("Optimizer.step#AdamW.step") == 2  # steps 3 and 4, no more
        # train.profile.memory=true on CPU ranks: each rank's own RSS and PSS at the window's end
        memory = json.loads((job / "profile" / f"memory_rank{rank}.json").read_text())
        assert memory["rank"] == rank and "snapshot" not in memory  # a CUDA snapshot on GPUs only
        assert 0 < memory["pss_bytes"] <= memory["rss_bytes"] and memory["peak_rss_bytes"] > 0
    profiles = read_profiles(job)  # report's table: collectives against the rest, per rank
    assert [p.rank for p in profiles] == [0, 1, 2, 3]
    for found in profiles:
        assert 0 < found.comm_s < found.window_s and not found.on_gpu, found
        assert found.comm_s + found.compute_s == pytest.approx(found.window_s)


@pytest.mark.slow
def test_stop_and_resume_gives_the_same_losses(tmp_path):
    grid = Grid(data=2, x=2)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    write_job(straight, grid)
    write_job(resumed, grid)
    launch(straight, 4, "axonn_launch.train")
    first = launch(resumed, 4, "tests.train.loop_worker", "--stop-after", "5", "--stop-rank", "1")
    summaries = [json.loads(out.strip().splitlines()[-1]) for out in first]
    assert all(s["stopped"] and s["steps"] == 5 for s in summaries)  # every rank stopped
    assert (resumed / "checkpoints" / "latest").read_text() == "step_00000005"
    assert [r["step"] for r in metrics(resumed)] == [1, 2, 3, 4, 5]
    # latest pointed at another run's (complete) step: never followed, this dir's newest is
    # used (a bug this catches: rank 0 checked the outside step, every rank opened its own)
    outside = os.path.relpath(straight / "checkpoints" / "step_00000012", resumed / "checkpoints")
    (resumed / "checkpoints" / "latest").write_text(outside)
    second = launch(resumed, 4, "tests.train.loop_worker")
    summary = json.loads(second[0].strip().splitlines()[-1])
    assert summary["resumed_from"] == 5 and summary["steps"] == 12 and not summary["stopped"]
    fallback = summary["checkpoint_fallback"]
    assert fallback["from_step"] is None and fallback["to_step"] == 5, fallback
    assert fallback["reason"].startswith(f"latest names {outside!r}, not a step_<n> of"), fallback
    expected, got = metrics(straight), metrics(resumed)
    assert [r["step"] for r in got] == list(range(1, 13))
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5, abs=0)
        assert b["lr"] == a["lr"]


def single_env() -> DistEnv:
    return DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=0,
        device="cpu",
        backend="gloo",
        source="single",
    )


def test_single_process_run_in_process(tmp_path):
    spec = write_job(tmp_path, Grid(), steps=8, warmup_steps=2, data="synthetic", seq_len=32)
    summary = run_job(spec, env=single_env())
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert summary["steps"] == 8 and summary["final_loss"] == rows[-1]["loss"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000008"
    again = run_job(spec, env=single_env())  # already finished: resumes at the end, no steps
    assert again["resumed_from"] == 8 and again["steps_run"] == 0


@pytest.mark.slow
def test_bf16_on_cpu_trains_to_a_finite_loss(tmp_path):
    """train.dtype=bf16 on CPU: autocast in the forward and the same state in the backward
    of the tensor-parallel layers (their custom autograd functions), over two ranks."""
    write_job(tmp_path, Grid(x=2), steps=4, warmup_steps=1, dtype="bf16", data="synthetic")
    launch(tmp_path, 2, "axonn_launch.train")
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and math.isfinite(summary["final_loss"])
    # bf16 really computed: the same job in fp32 gives close, not identical, losses
    fp32 = tmp_path / "fp32"
    write_job(fp32, Grid(x=2), steps=4, warmup_steps=1, dtype="fp32", data="synthetic")
    launch(fp32, 2, "axonn_launch.train")
    pairs = list(zip((r["loss"] for r in rows), (r["loss"] for r in metrics(fp32)), strict=True))
    assert all(low == pytest.approx(full, rel=0.05) for low, full in pairs), pairs
    # fp32 twice gives bit-identical losses here; bf16 rounding must show
    assert max(abs(low - full) / full for low, full in pairs) > 1e-6, pairs


@pytest.mark.parametrize(
    ("grid", "train", "message"),
    [
        (Grid(x=2), {}, "needs 2 ranks"),
        (Grid(), {"seq_len": 128}, "max_seq_len"),
        (Grid(), {"global_batch": 10}, "multiple"),
    ],
)
def test_run_rejects_inconsistent_specs(tmp_path, grid, train, message):
    spec = write_job(tmp_path, grid, **train)
    with pytest.raises(ValueError, match=message):
        run_job(spec, env=single_env())
