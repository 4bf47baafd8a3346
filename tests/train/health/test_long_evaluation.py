"""A long, healthy evaluation is not a hang, and a checkpoint exists before it.

The watchdog's evaluation deadline is per batch (the clock restarts at each batch), so
an evaluation of 300 batches under a 2 s floor completes, however long it takes in all;
before the change such a run ended ``hang`` with no checkpoint. The run's last save is
published before its last evaluation starts (the timeline's order).
"""

from __future__ import annotations

import json
from pathlib import Path

from axonn_launch.common.jobdir import JobPaths, read_timeline
from tests.conftest import run_launcher

REPO = Path(__file__).resolve().parents[3]
FLOOR_S = 2  # the floors the probe lowered, to make a long evaluation cheap
RUN = ["machine=local", "model=gpt_tiny", "grid.x=2", "train.warmup_steps=0",
       "train.sample_tokens=0", "train.progress=false", "train.steps=6",
       "train.eval_batches=300", "train.eval_every=0", f"train.watchdog.eval_floor_s={FLOOR_S}",
       f"train.watchdog.step_floor_s={FLOOR_S}", "train.watchdog.startup_steps=1"]  # fmt: skip


def test_an_evaluation_longer_than_its_deadline_completes_after_the_last_save(tmp_path):
    job = tmp_path / "job"
    done = run_launcher([*RUN, f"hydra.run.dir={job}"], cwd=REPO, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((job / "job.json").read_text())
    assert record["status"] == "completed", record
    events = read_timeline(job)
    (evaluation,) = [e for e in events if "eval" in e]
    (save,) = [e for e in events if e.get("checkpoint") == 6]
    # the evaluation outlived a deadline that, before, bounded the whole of it
    assert evaluation["end"] - evaluation["start"] > FLOOR_S, evaluation
    assert save["end"] <= evaluation["start"], (save, evaluation)
    rows = [json.loads(line) for line in JobPaths(job).metrics.read_text().splitlines()]
    assert rows[-1]["step"] == 6 and rows[-1]["val_loss"] > 0, rows[-1]
    assert not JobPaths(job).failures.exists() or not list(JobPaths(job).failures.iterdir())
