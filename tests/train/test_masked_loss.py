"""The loss over counted labels (Goldfish drops, fine-tuning masks) and the validation
loss are the same on every 4-rank grid as on one rank, and the one-rank values are the
mean cross-entropy over exactly the labels that count, although ranks hold different
numbers of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import GoldfishConfig, OverlapConfig
from axonn_launch.cost.planner import enumerate_grids
from axonn_launch.train.data import IGNORE_INDEX, EvalLoader, Geometry, Loader, open_source
from axonn_launch.train.loop import average_loss_and_flags, evaluate, run_micro_steps
from axonn_launch.train.models.gpt import finish_gradients, full_grad_dict
from axonn_launch.train.models.registry import build_model
from axonn_launch.train.parallel.groups import build_groups
from tests.train.dist_utils import run_world

SPEC = ModelSpec("llama-256", n_layer=2, d_model=32, n_head=4, vocab_size=256, max_seq_len=32,
                 arch="llama", n_kv_head=2, ffn_hidden=64, tie_embeddings=False)  # fmt: skip
GLOBAL_BATCH, ACCUMULATION, SEQ = 8, 2, 32
GOLDFISH = GoldfishConfig(k=3, h=4)
CPU = torch.device("cpu")


def _loaders(grid: Grid, coords) -> tuple[Loader, EvalLoader]:
    micro_batch = GLOBAL_BATCH // (ACCUMULATION * grid.data)
    geometry = Geometry(grid, coords, micro_batch, SEQ, ACCUMULATION)
    train = Loader(open_source("shakespeare", model_vocab=256), geometry, seed=5, goldfish=GOLDFISH)
    val = EvalLoader(open_source("shakespeare", model_vocab=256, split="val"), geometry, batches=2)
    return train, val


def _step(rank: int, world_size: int, grids: list[Grid]) -> list[tuple]:
    """(loss, gathered gradients, validation loss, local counted labels) per grid."""
    results = []
    for grid in grids:
        groups = build_groups(grid, rank=rank)
        model = build_model(SPEC, groups=groups, overlap=OverlapConfig(), seed=3)
        train, val = _loaders(grid, groups.coords)
        batches = train.next_step()
        share = run_micro_steps(model, batches, groups, CPU, torch.float32)
        loss, _ = average_loss_and_flags(share, (), CPU, groups)
        finish_gradients(model, groups, average=False)
        grads = {n: g.numpy() for n, g in full_grad_dict(model, groups).items()}
        val_loss = evaluate(model, list(val), groups, CPU, torch.float32)
        counted = int(sum((b.targets != IGNORE_INDEX).sum() for b in batches))
        results.append((loss, grads, val_loss, counted))
    return results


@pytest.fixture(scope="module")
def one_rank():
    (result,) = run_world(_step, 1, [Grid()])
    return result[0]


def test_one_rank_loss_is_the_mean_over_counted_labels(one_rank):
    loss, _, _, counted = one_rank
    groups = build_groups(Grid(), rank=0)
    model = build_model(SPEC, groups=groups, overlap=OverlapConfig(), seed=3)
    train, _ = _loaders(Grid(), groups.coords)
    batches = train.next_step()
    inputs = torch.cat([b.inputs for b in batches])
    targets = torch.cat([b.targets for b in batches])
    logits = model.all_logits(inputs)
    expected = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1), ignore_index=-100)
    assert counted == int((targets != IGNORE_INDEX).sum()) < targets.numel() * 0.8
    assert loss == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.slow
def test_every_4_rank_grid_equals_one_rank(one_rank):
    ref_loss, ref_grads, ref_val, _ = one_rank
    grids = enumerate_grids(4)
    per_rank = run_world(_step, 4, grids)
    uneven = False
    for i, grid in enumerate(grids):
        rows = [results[i] for results in per_rank]
        counts = {r[3] for r in rows}
        uneven |= len(counts) > 1
        for loss, grads, val_loss, _ in rows:
            assert loss == pytest.approx(ref_loss, rel=1e-5), grid.describe()
            assert val_loss == pytest.approx(ref_val, rel=1e-5), grid.describe()
            for name, expected in ref_grads.items():
                np.testing.assert_allclose(grads[name], expected, rtol=1e-4, atol=1e-7,
                                           err_msg=f"{grid.describe()} {name}")  # fmt: skip
    assert uneven  # some grid's ranks held different numbers of counted labels
