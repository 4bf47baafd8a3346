"""Sampling: greedy decoding equals repeated argmax of the model; seeded sampling repeats."""

from __future__ import annotations

import torch

from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.train.inference.generation import decode, default_prompt, generate_one
from axonn_launch.train.loop import StopFlag
from axonn_launch.train.models.gpt import GPT
from axonn_launch.train.parallel.groups import single_process_groups

SPEC = ModelSpec("s", n_layer=1, d_model=32, n_head=4, vocab_size=64, max_seq_len=8)
CPU = torch.device("cpu")


def model() -> GPT:
    return GPT(SPEC, groups=single_process_groups(), overlap=OverlapConfig(), seed=3)


def test_greedy_matches_repeated_argmax_with_a_sliding_window():
    net = model()
    tokens = generate_one(net, [1, 2], 10, max_seq_len=8, device=CPU, temperature=0)
    expected = [1, 2]
    with torch.no_grad():
        for _ in range(10):
            logits = net(torch.tensor([expected[-8:]]))
            expected.append(int(logits[0].argmax()))
    assert tokens == expected
    assert len(tokens) == 12 and net.training  # the model's mode is restored


def test_sampling_is_seeded():
    net = model()
    a = generate_one(net, [5], 12, max_seq_len=8, device=CPU, temperature=1.0, seed=1)
    b = generate_one(net, [5], 12, max_seq_len=8, device=CPU, temperature=1.0, seed=1)
    c = generate_one(net, [5], 12, max_seq_len=8, device=CPU, temperature=1.0, seed=2)
    assert a == b and a != c
    assert all(0 <= t < SPEC.vocab_size for t in a)


def test_decode_and_prompt():
    assert decode(list(b"To be"), "shakespeare") == "To be"
    assert decode([3, 4], "synthetic") == "3 4"
    assert default_prompt("shakespeare") == [10]


def test_stop_flag_can_be_a_signal_handler():
    flag = StopFlag()
    assert flag() is False
    flag.request(12, None)  # the (signum, frame) a signal handler receives
    assert flag() is True
