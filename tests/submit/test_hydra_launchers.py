"""Hydra beyond its basic launcher and sweeper: the joblib and submitit_local launchers
(points run in other processes), and Optuna optimizing a real objective on machine=local."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from axonn_launch.config.compose import load
from axonn_launch.submit.pipeline import Outcome
from axonn_launch.submit.sweep import expand_sweep, with_objective
from tests.conftest import run_launcher

pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install -e '.[sweep]'")
pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[sweep]'")
pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[sweep]'")


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_a_sweep_with_an_invalid_point_prints_the_summary_and_exits_1(
    tmp_path, fake_sbatch, launcher
):
    bindir, marker = fake_sbatch
    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        f"hydra/launcher={launcher}",
        "machine=slurm_local",
        "grid.x=2",
        "grid.z=1,2,3",
        "dry_run=true",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    result = run_launcher(args, cwd=tmp_path, path_prefix=bindir, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    table = result.stdout.split("sweep summary:")[1]
    assert re.search(r"\n0 .*grid.z=1 dry_run=True\s+dry_run\s+-\s+1\s", table), table
    assert re.search(r"\n1 .*grid.z=2 dry_run=True\s+dry_run\s+-\s+2\s", table), table
    assert re.search(r"\n2 .*grid.z=3 dry_run=True\s+invalid(?:\s+-){7}\s+grid.z=3: ", table), table
    table, next_line = table.split("next: ")
    assert next_line.startswith("fix or leave out point 2 ")
    assert (sweep_dir / "summary.txt").read_text() == "sweep summary:" + table
    nodes = sorted(json.loads(p.read_text())["nodes"] for p in sweep_dir.glob("*/job.json"))
    assert nodes == [1, 2]  # the invalid point left no job directory
    assert not marker.exists()


def test_a_valid_sweep_under_joblib_exits_0(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=joblib", "machine=slurm_local", "grid.x=2", "grid.z=1,2",
            "dry_run=true", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    result = run_launcher(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(re.findall(r"\sdry_run\s", result.stdout.split("sweep summary:")[1])) == 2


@pytest.mark.slow
def test_optuna_sweep_over_lr_on_local_runs_two_trials_and_reports_the_best(tmp_path):
    """Two trials, each a local run that imports torch (three took 58 s in the last full
    run): two are the fewest that make a best-of-several (tests/README.md)."""
    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=7",
        "train.lr=interval(0.001,0.01)",
        "machine=local",
        "grid.x=1",
        "grid.z=1",
        "train.steps=4",
        "train.warmup_steps=1",
        "train.sample_tokens=0",
        "train.progress=false",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    result = run_launcher(args, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trials = sorted(sweep_dir.glob("*/summary.json"))
    assert len(trials) == 2
    losses = [json.loads(p.read_text())["val_loss"] for p in trials]  # the default objective
    lrs = [yaml.safe_load((p.parent / "config.yaml").read_text())["train"]["lr"] for p in trials]
    assert len(set(lrs)) == 2 and all(0.001 <= lr <= 0.01 for lr in lrs)
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["best_value"] == min(losses)
    assert results["best_params"]["train.lr"] == lrs[losses.index(min(losses))]
    assert f"Best value: {min(losses)}" in result.stdout + result.stderr
    table = result.stdout.split("sweep summary:")[1]
    assert len(re.findall(r"\scompleted\s", table)) == 2 and "val_loss" in table


def test_preflight_samples_sweeps_only_their_sweeper_can_expand():
    points = expand_sweep(
        [
            "train.lr=interval(0.001,0.1)",
            "train.seed=tag(log, interval(1, 100))",
            "grid.z=1,2",
            "train.steps=range(10,30,10)",
        ]
    )
    assert points == [
        ["train.lr=0.001", "train.seed=1", "grid.z=1", "train.steps=10"],
        ["train.lr=0.001", "train.seed=1", "grid.z=1", "train.steps=20"],
        ["train.lr=0.001", "train.seed=1", "grid.z=2", "train.steps=10"],
        ["train.lr=0.001", "train.seed=1", "grid.z=2", "train.steps=20"],
    ]


def test_preflight_of_an_optimizing_sweep_takes_both_ends_of_each_interval():
    points = expand_sweep(
        ["train.lr=interval(0.001,0.1)", "train.seed=tag(log, interval(1, 100))", "grid.z=1,2"],
        interval_ends=True,
    )
    assert len(points) == 8
    assert {p[0] for p in points} == {"train.lr=0.001", "train.lr=0.1"}
    assert {p[1] for p in points} == {"train.seed=1", "train.seed=100"}
    assert {p[2] for p in points} == {"grid.z=1", "grid.z=2"}


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["train.lrr=interval(0.001,0.1)"], "error: train.lrr: unknown key"),
        (["train.lr=interval(0.001,0.1)", "wait=false"], "error: wait=false: the optuna sweeper"),
        (
            ["train.lr=interval(0.001,0.1)", "train.eval_batches=0"],
            "error: objective=val_loss needs a validation loss: train.eval_batches=0",
        ),
        (  # a trial below train.min_lr would stop the sweep midway
            ["train.lr=interval(0.0001,0.01)"],
            "error: train.min_lr=0.0003: must not exceed train.lr=0.0001 (a trial the optuna"
            " sweeper may pick: train.lr=0.0001)",
        ),
        (  # every choice too: any of them may be a trial
            ["train.seed=interval(1,2)", "grid.z=1,3"],
            "error: grid.z=3: must divide",
        ),
        (
            ["train.lr=interval(0.001,0.1)", "objective=loss"],
            "error: objective='loss': valid: val_loss, final_loss, tokens_per_s",
        ),
    ],
)
def test_an_optuna_sweep_with_bad_input_stops_before_anything_runs(tmp_path, args, error):
    result = run_launcher(
        ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", *args], cwd=tmp_path
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(error), line
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize(
    ("objective", "expected"), [("val_loss", 2.7), ("final_loss", 2.5), ("tokens_per_s", 1500.0)]
)
def test_a_point_returns_its_objective_from_the_jobs_summary(tmp_path, objective, expected):
    summary = {"val_loss": 2.7, "final_loss": 2.5, "tokens_per_s": 1500.0, "steps": 4}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert load([f"objective={objective}"]).objective == objective
    done = with_objective(Outcome("completed", str(tmp_path)), objective)
    assert float(done) == expected
    failed = with_objective(Outcome("failed", str(tmp_path), message="exit code 1"), objective)
    with pytest.raises(ValueError, match=f"no {objective}: failed exit code 1"):
        float(failed)  # the sweeper records a failed trial
