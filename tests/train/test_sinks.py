"""The metric sinks on their own, in this process (no training run): a missing ``wandb``
and a sink that fails each cost one log line and stop nothing; a resumed attempt's
TensorBoard events read back as one series. The sinks across a real killed and healed
run are checked in tests/submit/test_local_recovery.py (local) and
tests/slurm/test_recovery.py (Slurm); the default run's events in
tests/journeys/test_first_day_loss.py.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from axonn_launch import jobs
from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import JobSpec, RuntimeConfig, TrainConfig
from axonn_launch.common.tracking import MetricsConfig, ProfileConfig
from axonn_launch.config.compose import ConfigError, build
from axonn_launch.train.sinks import Sinks, WandbSink, open_sinks
from tests.train.tracker_files import as_float32, tb_series, wandb_history

TINY = ModelSpec(name="tiny", n_layer=1, n_head=2, d_model=16, vocab_size=64, max_seq_len=16)


def spec_in(job_dir: Path, sinks: list[str]) -> JobSpec:
    return JobSpec(name="sinks", job_dir=str(job_dir), model=TINY, grid=Grid(),
                   train=TrainConfig(steps=4, micro_batch=1), runtime=RuntimeConfig(device="cpu"),
                   metrics=MetricsConfig(sinks=sinks))  # fmt: skip


def row(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1,
            "tokens_per_s": 100.0, "tflops_per_gpu": 0.01, "mfu": None, "mem_gb": 0.5}  # fmt: skip


@pytest.fixture
def said() -> list[str]:
    """The sinks' log lines (the package logger may not propagate to pytest's)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("axonn_launch.train.sinks")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def test_without_wandb_installed_one_line_says_so_and_the_other_sinks_go_on(
    tmp_path, monkeypatch, said
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    sinks = open_sinks(spec_in(tmp_path, ["jsonl", "tensorboard", "wandb"]), start_step=0,
                       attempt=1, enabled=True)  # fmt: skip
    assert [s.name for s in sinks.sinks] == ["tensorboard"]
    assert said == [
        "metrics sink wandb: wandb is not installed (pip install -e '.[wandb]'); "
        "training goes on without it"
    ]
    for step in (1, 2):
        sinks.log(row(step, 3.0 - step))
    sinks.close({"steps": 2, "final_loss": 1.0})
    assert tb_series(tmp_path / "tensorboard", "loss") == [(1, 2.0), (2, 1.0)]


def test_a_sink_that_fails_is_dropped_with_one_line(tmp_path, said):
    """A real failure: a W&B run finished under the sink's feet refuses the rows."""
    sinks = open_sinks(spec_in(tmp_path, ["wandb"]), start_step=0, attempt=1, enabled=True)
    (sink,) = sinks.sinks
    assert isinstance(sink, WandbSink)
    sink.run.finish()
    sinks.log(row(1, 2.0))
    sinks.close({"steps": 1, "final_loss": 2.0})  # sends the row: refused
    assert len(said) == 1 and said[0].startswith("metrics sink wandb failed: "), said
    assert "\n" not in said[0] and said[0].endswith("training goes on without it")
    assert sinks.sinks == []
    sinks.log(row(2, 1.0))  # nothing left to fail


def test_a_resumed_attempt_purges_what_the_killed_one_logged_past_its_checkpoint(tmp_path):
    """Attempt 1 logs steps 1-5 and dies; attempt 2 resumes from step 3's checkpoint with
    other values: TensorBoard shows 1-3 of attempt 1, then 4-6 of attempt 2, once each."""
    spec = spec_in(tmp_path, ["tensorboard"])
    first = open_sinks(spec, start_step=0, attempt=1, enabled=True)
    for step in range(1, 6):
        first.log(row(step, 10.0 + step))
    first.close()
    second = open_sinks(spec, start_step=3, attempt=2, enabled=True)
    for step in range(4, 7):
        second.log(row(step, 20.0 + step))
    second.close({"steps": 6, "final_loss": 26.0})
    assert tb_series(tmp_path / "tensorboard", "loss") == [
        (1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)
    ]  # fmt: skip
    assert tb_series(tmp_path / "tensorboard", "attempt") == [(1, 1.0), (4, 2.0)]
    assert as_float32(0.1) in [v for _, v in tb_series(tmp_path / "tensorboard", "step_time_s")]


def test_other_ranks_open_no_sink(tmp_path):
    sinks = open_sinks(spec_in(tmp_path, ["tensorboard", "wandb"]), start_step=0, attempt=1,
                       enabled=False)  # fmt: skip
    assert isinstance(sinks, Sinks) and sinks.sinks == []
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_offline_resumes_one_run_and_sends_each_final_row_once(tmp_path, capfd):
    """Attempt 1 logs 1-5, step 4's checkpoint is published, and it fails (closed without
    a summary): rows 1-4 are sent. Attempt 2 resumes from step 4 and finishes at 6.
    ``jobs sync --dry-run`` names both folders for wandb's sync."""
    spec = spec_in(tmp_path, ["wandb"])
    latest = tmp_path / "checkpoints" / "latest"
    latest.parent.mkdir()
    first = open_sinks(spec, start_step=0, attempt=1, enabled=True)
    for step in range(1, 6):
        first.log(row(step, 10.0 + step))
    latest.write_text("step_4")
    first.close()
    second = open_sinks(spec, start_step=4, attempt=2, enabled=True)
    for step in (5, 6):
        second.log(row(step, 20.0 + step))
    second.close({"steps": 6, "final_loss": 26.0})
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))
    rows = [r for folder in folders for r in wandb_history(folder)]
    assert [(r["_step"], r["loss"], r["attempt"]) for r in rows] == [
        (1, 11.0, 1), (2, 12.0, 1), (3, 13.0, 1), (4, 14.0, 1), (5, 25.0, 2), (6, 26.0, 2)
    ]  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps({"job_ids": ["local-1"]}))
    capfd.readouterr()
    assert jobs.main(["sync", str(tmp_path), "--dry-run"]) == 0
    said = "".join(capfd.readouterr())
    assert "Would sync 2 run(s)" in said and all(f.name in said for f in folders), said


@pytest.mark.parametrize("raw", [{"sinks": ["jsonl", "tb"]}, {"wandb": {"mode": "cloud"}}])
def test_the_job_refuses_what_the_login_node_refuses_in_the_same_words(tmp_path, raw):
    """The launcher's check (config/compose.py's ``build``) and the job's reading of
    spec.json (``JobSpec.from_json``) refuse the same metrics settings, in one line."""
    with pytest.raises(ConfigError) as login:
        build(MetricsConfig, raw, "metrics")
    spec = json.loads(spec_in(tmp_path, ["jsonl"]).to_json()) | {"metrics": raw}
    with pytest.raises(ValueError) as job:
        JobSpec.from_json(json.dumps(spec))
    assert str(job.value) == str(login.value) and "\n" not in str(login.value)


def test_a_memory_profile_without_its_window_is_refused_in_one_line():
    """The login node (config/compose.py's ``build``) and the job (the dataclass itself)
    read train.profile alike: memory records over the steps' window, so it needs one."""
    with pytest.raises(ConfigError) as login:
        build(ProfileConfig, {"memory": True}, "train.profile")
    assert str(login.value) == (
        "train.profile.memory=true: records over a window; set train.profile.steps=a-b too"
        " (e.g. 3-4), or train.profile.memory=false"
    )
