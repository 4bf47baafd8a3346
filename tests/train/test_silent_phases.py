"""A phase of the job that would keep the console quiet past ``SILENT_S`` says so in one
line: the end-of-run sample from its first token's pace, a final save once it ran that long."""

from __future__ import annotations

import logging
import time

import torch

from axonn_launch.train.inference.generation import generate_one
from axonn_launch.train.run import SILENT_S, announce_sample, said_if_slow
from tests.train.inference.test_sample import CPU, model


class SlowForward(torch.nn.Module):
    """The test model, each forward taking ``seconds`` longer (a slow device)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.net, self.seconds = model(), seconds

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.net(context)


def test_the_sample_predicts_its_length_from_its_first_token():
    expected: list[float] = []
    generate_one(SlowForward(0.05), [1], 6, max_seq_len=8, device=CPU, expect=expected.append)
    (seconds,) = expected  # once, after the first token
    assert 6 * 0.05 <= seconds < 6 * 0.05 + 1.0


def test_only_a_long_sample_is_announced_and_only_by_rank_0(caplog):
    with caplog.at_level(logging.INFO, logger="axonn_launch"):
        announce_sample(0, 64, SILENT_S - 1)
        announce_sample(1, 64, 100)
        announce_sample(0, 64, 100)
    assert [r.getMessage() for r in caplog.records] == [
        "sampling 64 tokens from the trained model: about 100 s"
    ]


def test_a_save_still_running_after_the_limit_says_so_once(caplog):
    with caplog.at_level(logging.INFO, logger="axonn_launch"):
        with said_if_slow(0, "writing the checkpoint of step 8", after_s=0.2):
            time.sleep(0.6)
        with said_if_slow(0, "a quick one", after_s=0.5):
            pass
        with said_if_slow(1, "rank 1 says nothing", after_s=0.1):
            time.sleep(0.3)
    assert [r.getMessage() for r in caplog.records] == [
        "writing the checkpoint of step 8 (0 s so far)"
    ]
