"""The default job's loss curve has no spike.

With 20 warm-up steps the full learning rate (3e-3) arrived just as the model left its
unigram plateau, and one step overshot: loss 6.85 at step 24 (gradient norm 200), then
straight back. The default job runs here as a new user runs it (``python -m
axonn_launch``, all 200 steps; a run of fewer steps differs in its schedule), less the
sample after training (``train.sample_tokens=0``: about a quarter of the run's CPU, and no part
of the curve; the default line's sample is checked by tests/journeys/test_readme.py and
test_first_day_console.py): after
warm-up no loss reaches the first step's, and at no step does the loss rise a nat above
the lowest loss before it.

Only the default grid (x2 z2) runs: every other grid computes the same losses to rounding
(tests/train/models/test_model_exact.py), so a second 200-step run of another grid checked the
schedule again, not the grid.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_launcher
from tests.train.tracker_files import as_float32, tb_series

SPIKE_NATS = 1.0  # far above the step-to-step noise of a batch of 16 x 64 bytes (~0.2)


def losses(job: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.mark.slow
def test_the_default_job_has_no_loss_spike(tmp_path):
    """Over 60 s under load: the default job's 200 steps, as a new user runs it (no sample)."""
    job = tmp_path / "job"
    proc = run_launcher(
        ["train.sample_tokens=0", f"hydra.run.dir={job}"], cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = json.loads((job / "spec.json").read_text())
    axes = [spec["grid"][axis] for axis in ("data", "x", "y", "z")]
    assert axes == [1, 2, 1, 2]
    steps, warmup = spec["train"]["steps"], spec["train"]["warmup_steps"]
    loss = losses(job)
    assert sorted(loss) == list(range(1, steps + 1)) and warmup < steps
    highest = max(range(warmup + 1, steps + 1), key=loss.get)
    assert loss[highest] < loss[1], f"step {highest}: loss {loss[highest]:.3f} >= step 1's"
    for step in range(2, steps + 1):
        lowest = min(loss[s] for s in range(1, step))
        assert loss[step] - lowest < SPIKE_NATS, f"step {step}: {loss[step]:.3f} after {lowest:.3f}"
    # no sink named: TensorBoard's event files too, one loss per step, metrics.jsonl's
    shown = tb_series(job / "tensorboard", "loss")
    assert shown == [(step, as_float32(loss[step])) for step in range(1, steps + 1)]
