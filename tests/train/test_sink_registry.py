"""A metric sink is one module plus one registration line: a fake one, registered here,
passes the login side's ``metrics.sinks`` check and gets the job's rows, in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from axonn_launch.common import tracking
from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import JobSpec, RuntimeConfig, TrainConfig
from axonn_launch.common.tracking import MetricsConfig, MetricSink, register_sink
from axonn_launch.train.sinks import SinkOpening, open_sinks

TINY = ModelSpec(name="tiny", n_layer=1, n_head=2, d_model=16, vocab_size=64, max_seq_len=16)


class FakeSink:
    """Keeps what it is given."""

    name = "fake"
    opened: list[FakeSink] = []

    def __init__(self, at: SinkOpening) -> None:
        self.at, self.rows, self.steps, self.summary = at, [], [], None
        FakeSink.opened.append(self)

    def log(self, row: dict) -> None:
        self.rows.append(row)

    def checkpointed(self, step: int) -> None:
        self.steps.append(step)

    def close(self, summary: dict | None) -> None:
        self.summary = summary


def open_fake(at: SinkOpening) -> FakeSink:
    return FakeSink(at)


@pytest.fixture
def fake_sink():
    register_sink(MetricSink("fake", f"{__name__}:open_fake"))  # the one registration line
    FakeSink.opened.clear()
    yield
    del tracking.SINKS["fake"]


def test_a_registered_sink_is_valid_on_the_login_side_and_gets_rows(tmp_path: Path, fake_sink):
    metrics = MetricsConfig.from_dict({"sinks": ["jsonl", "fake"]})
    spec = JobSpec(name="fake", job_dir=str(tmp_path), model=TINY, grid=Grid(),
                   train=TrainConfig(steps=2, micro_batch=1), runtime=RuntimeConfig(device="cpu"),
                   metrics=metrics)  # fmt: skip
    sinks = open_sinks(spec, start_step=3, attempt=2, enabled=True)
    sinks.log({"step": 4, "loss": 1.5})
    sinks.checkpointed(4)
    sinks.close({"steps": 4})
    (sink,) = FakeSink.opened
    assert (sink.at.start_step, sink.at.attempt, sink.at.root) == (3, 2, tmp_path)
    assert (sink.rows, sink.steps, sink.summary) == ([{"step": 4, "loss": 1.5}], [4], {"steps": 4})


def test_an_unregistered_sink_is_refused_with_the_registered_names(fake_sink):
    with pytest.raises(ValueError, match="'nope'; valid: jsonl, tensorboard, wandb, fake$"):
        MetricsConfig(sinks=["nope"])
    with pytest.raises(ValueError, match="already registered"):
        register_sink(MetricSink("fake", f"{__name__}:open_fake"))
