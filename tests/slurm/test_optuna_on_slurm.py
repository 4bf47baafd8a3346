"""An optimizing sweeper on the real local Slurm cluster: each trial is a Slurm job that
the sweep waits for (wait=true implied), and Optuna's best value is the lowest validation
loss (the default objective)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import run_launcher

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[sweep]'")
pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install -e '.[sweep]'")


def test_optuna_trials_are_slurm_jobs_that_the_sweep_waits_for(slurm_cluster, tmp_path):
    """Over 30 s: two trials, each a Slurm job that the sweep waits for. Both in one batch
    (``hydra.sweeper.n_jobs=2``), run side by side by the joblib launcher, each waited for
    in its own process (the basic launcher's trials, one after another, are
    tests/submit/test_hydra_launchers.py's)."""
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2",
            "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
            "hydra.sweeper.sampler.seed=7", "train.lr=interval(0.001,0.01)",
            "machine=slurm_local", "grid.x=2",
            "train.steps=3", "train.warmup_steps=1", "train.sample_tokens=0",
            "train.progress=false", "preflight=false", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    result = run_launcher(args, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/job.json"))]
    assert len(records) == 2
    assert all(r["status"] == "completed" and r["slurm_state"] == "COMPLETED" for r in records)
    losses = [json.loads(p.read_text())["val_loss"] for p in sorted(sweep.glob("*/summary.json"))]
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())["best_value"]
    assert len(losses) == 2 and best == min(losses)
