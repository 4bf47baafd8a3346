"""The job's AdamW (``train/models/adamw.py``) against ``torch.optim.AdamW``, to the bit, and
what it leaves out of a rank: ``torch._dynamo``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from axonn_launch.train.models.adamw import AdamW

SHAPES = [(8, 16), (16,), (3, 5, 7)]
STEPS = 40


def parameters(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]


def groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """Two groups, as the job builds them: weight decay on matrices, none on the rest."""
    return [
        {"params": [params[0], params[2]], "weight_decay": 0.1},
        {"params": [params[1]], "weight_decay": 0.0},
    ]


def train(optimizer, params: list[torch.nn.Parameter], steps: int, first: int = 0) -> None:
    """``steps`` updates with seeded gradients (growing, as early training's do) and a
    decaying learning rate set on every group, as the job's schedule does."""
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(1000 + step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator) * (step + 1)
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * 0.97**step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("foreach", [None, True], ids=["torch-default", "torch-foreach"])
def test_every_update_equals_torch_adamw_to_the_bit(foreach):
    """On CPU torch loops over the parameters by default; foreach=True is its GPU path."""
    ours, theirs = parameters(0), parameters(0)
    expected = torch.optim.AdamW(groups(theirs), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                                 foreach=foreach)  # fmt: skip
    found = AdamW(groups(ours), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    train(expected, theirs, STEPS)
    train(found, ours, STEPS)
    for mine, torchs in zip(ours, theirs):
        assert torch.equal(mine, torchs)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(found.state[mine][key], expected.state[torchs][key]), key
    assert ours[0].abs().max() < parameters(0)[0].abs().max()  # the decay moved them


def test_a_torch_state_dict_loads_and_training_goes_on_the_same():
    """The per-rank checkpoints of ``checkpoint/legacy.py`` hold torch.optim's layout."""
    ours, theirs = parameters(0), parameters(0)
    expected = torch.optim.AdamW(groups(theirs), lr=3e-3, betas=(0.9, 0.95))
    train(expected, theirs, 10)
    for mine, torchs in zip(ours, theirs):
        mine.data.copy_(torchs.data)
    found = AdamW(groups(ours), lr=1.0, betas=(0.9, 0.95))
    found.load_state_dict(expected.state_dict())
    assert found.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.97**9)
    train(expected, theirs, 10, first=10)
    train(found, ours, 10, first=10)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    mine = found.state_dict()
    assert [g["params"] for g in mine["param_groups"]] == [[0, 1], [2]]
    assert sorted(mine["state"]) == [0, 1, 2]
    assert torch.equal(mine["state"][2]["exp_avg"], expected.state[theirs[1]]["exp_avg"])


def test_a_state_dict_for_other_groups_is_refused():
    found = AdamW(groups(parameters(0)), lr=1e-3)
    other = AdamW([{"params": parameters(0)}], lr=1e-3)
    with pytest.raises(ValueError, match="other parameter groups"):
        found.load_state_dict(other.state_dict())


def test_a_training_step_leaves_torch_dynamo_unimported():
    """What a rank runs for a step (the job's model, optimizer and loss) in a fresh Python:
    torch.optim's optimizers would import torch._dynamo (about 210 modules)."""
    code = (
        "import sys, torch\n"
        "from axonn_launch.common.spec import TrainConfig\n"
        "from axonn_launch.train.models.optim import build_optimizer\n"
        "model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))\n"
        "optimizer = build_optimizer(model, TrainConfig())\n"
        "idx = torch.randint(0, 16, (4, 3))\n"
        "loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())\n"
        "loss.backward(); optimizer.step(); optimizer.zero_grad()\n"
        "assert optimizer.state, 'no step was taken'\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)  # fmt: skip
    assert result.stdout.split() == ["False"]
