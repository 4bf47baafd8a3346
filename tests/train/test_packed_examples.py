"""Fine-tuning rows that pack several examples: the loader marks each token's example
(from the ``.idx`` sequences of a packed document), and the model keeps attention and
positions inside an example, so a packed example's loss is its loss alone, on every grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from axonn_launch.common.grid import Grid
from axonn_launch.common.indexed import IndexedWriter, token_dtype
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import GoldfishConfig, OverlapConfig
from axonn_launch.cost.planner import enumerate_grids
from axonn_launch.train.data import IGNORE_INDEX, Geometry, Loader, open_source
from axonn_launch.train.loop import average_loss_and_flags, run_micro_steps
from axonn_launch.train.models.gpt import finish_gradients, full_grad_dict
from axonn_launch.train.models.registry import build_model
from axonn_launch.train.parallel.attention import Positions, example_firsts
from axonn_launch.train.parallel.groups import build_groups
from tests.train.dist_utils import run_world

VOCAB, SEQ = 256, 24
LLAMA = ModelSpec("llama-256", n_layer=2, d_model=32, n_head=4, vocab_size=VOCAB,
                  max_seq_len=SEQ, arch="llama", n_kv_head=2, ffn_hidden=64,
                  tie_embeddings=False)  # fmt: skip
GPT = ModelSpec("gpt-256", n_layer=2, d_model=32, n_head=4, vocab_size=VOCAB, max_seq_len=SEQ)
CPU = torch.device("cpu")


def write_packed(prefix: Path, rows: list[list[int]], seed: int = 0) -> Path:
    """Rows of ``SEQ + 1`` tokens, each packing examples of the given sizes."""
    rng = np.random.default_rng(seed)
    with IndexedWriter(prefix, token_dtype(VOCAB), masked=True) as writer:
        for sizes in rows:
            assert sum(sizes) == SEQ + 1
            tokens = rng.integers(0, VOCAB, SEQ + 1)
            mask = (rng.random(SEQ + 1) < 0.7).astype(np.uint8)
            writer.add(tokens, sizes, mask, one_document=True)
        writer.commit({"vocab_size": VOCAB})
    return prefix.with_name(prefix.name + ".bin")


ROWS = [[10, 15], [25], [4, 9, 12], [7, 7, 7, 4], [20, 5], [25], [3, 22], [12, 13]] * 2


def loader(source, grid: Grid | None = None, rank: int = 0, *, micro_batch: int = 4) -> Loader:
    grid = grid or Grid()
    return Loader(source, Geometry(grid, grid.coords(rank), micro_batch, SEQ, 1), seed=3)


def test_the_loader_numbers_each_tokens_example_within_its_row(tmp_path):
    source = open_source(str(write_packed(tmp_path / "p", ROWS)), model_vocab=VOCAB, split="all")
    load = loader(source, micro_batch=len(ROWS))
    inputs, _, examples = load.batch(0, 0)
    assert examples is not None and examples.shape == inputs.shape == (len(ROWS), SEQ)
    rows = {tuple(r) for r in ROWS}
    for row_examples in examples.tolist():
        runs = [sum(1 for e in row_examples if e == n) for n in range(max(row_examples) + 1)]
        runs[-1] += 1  # the row's last token is a label only
        assert tuple(runs) in rows
        assert row_examples == sorted(row_examples)


def test_goldfish_static_counts_positions_from_each_examples_first_token(tmp_path):
    """The static strategy drops labels 0, k, 2k, ... of a document (axonn.md 7.2); a
    packed example is a document, so the count starts again at each example of a row."""
    pytest.importorskip("axonn_launch.train.goldfish")
    source = open_source(str(write_packed(tmp_path / "p", ROWS)), model_vocab=VOCAB, split="all")
    k, rows = 3, len(ROWS)
    static = GoldfishConfig(k=k, h=2, strategy="static")
    geometry = Geometry(Grid(), Grid().coords(0), rows, SEQ, 1)
    fish = Loader(source, geometry, seed=3, goldfish=static)
    _, fished, examples = fish.batch(0, 0)
    _, plain, _ = loader(source, micro_batch=rows).batch(0, 0)
    for r in range(rows):
        sizes = torch.bincount(examples[r]).tolist()
        sizes[-1] += 1  # the row's last token, a label only, ends its last example
        offsets = torch.cat([torch.arange(n) for n in sizes])  # each token's, in its example
        label = offsets[1:] - 1  # a label's index among its example's labels
        drop = (label >= 0) & (label % k == 0)
        assert torch.equal(fished[r], plain[r].masked_fill(drop, IGNORE_INDEX)), ROWS
    assert (fished == IGNORE_INDEX).sum() > (plain == IGNORE_INDEX).sum()


def test_rows_of_one_example_each_keep_plain_causal_attention(tmp_path):
    source = open_source(str(write_packed(tmp_path / "p", [[25]] * 8)), model_vocab=VOCAB)
    assert loader(source).batch(0, 0).examples is None


def test_positions_count_from_each_examples_first_token():
    examples = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]])
    where = Positions(examples=examples)
    assert example_firsts(examples).tolist() == [[0, 0, 0, 3, 3, 5, 5, 5], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert where.ids(2, 8, CPU).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 5, 6]]
    mask = where.mask(2, 8, CPU)[:, 0]
    assert mask[0, 4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[1, 7].tolist() == [False] + [True] * 7
    with pytest.raises(ValueError, match="from position 0, unpadded"):
        Positions(start=3, examples=examples)


@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=lambda s: s.arch)
def test_a_packed_examples_loss_is_its_loss_alone(spec):
    """Row = [A (9 tokens) | B (16 tokens)]: B's labels give the loss B gives at the start
    of a row of its own; without the example numbers they would not."""
    groups = build_groups(Grid(), rank=0)
    model = build_model(spec, groups=groups, overlap=OverlapConfig(), seed=3)
    rng = np.random.default_rng(7)
    row = torch.from_numpy(rng.integers(0, VOCAB, SEQ + 1)).reshape(1, -1)
    inputs, labels = row[:, :-1], row[:, 1:]
    cut = 9  # B is row tokens 9..24: inputs 9..23 and their labels
    b_targets = labels.clone()
    b_targets[:, :cut] = IGNORE_INDEX
    examples = (torch.arange(SEQ) >= cut).long().reshape(1, -1)
    alone_inputs = torch.zeros_like(inputs)  # B first, then filler it cannot see
    alone_inputs[:, : SEQ - cut] = inputs[:, cut:]
    alone_targets = torch.full_like(labels, IGNORE_INDEX)
    alone_targets[:, : SEQ - cut] = labels[:, cut:]
    with torch.no_grad():
        packed = model(inputs, b_targets, examples=examples)
        alone = model(alone_inputs, alone_targets)
        mixed = model(inputs, b_targets)
    assert float(packed) == pytest.approx(float(alone), rel=1e-5)
    assert abs(float(mixed) - float(alone)) > 1e-3


def _packed_step(rank: int, world_size: int, grids: list[Grid], path: str) -> list[tuple]:
    """(loss, gathered gradients) of one step on packed rows, per grid."""
    results = []
    for grid in grids:
        groups = build_groups(grid, rank=rank)
        model = build_model(LLAMA, groups=groups, overlap=OverlapConfig(), seed=3)
        source = open_source(path, model_vocab=VOCAB, split="all")
        batches = [loader(source, grid, rank, micro_batch=8 // grid.data).batch(0, 0)]
        if grid.world_size == 1:  # some of a rank's rows may each be one example
            assert batches[0].examples is not None
        share = run_micro_steps(model, batches, groups, CPU, torch.float32)
        loss, _ = average_loss_and_flags(share, (), CPU, groups)
        finish_gradients(model, groups, average=False)
        grads = {n: g.numpy() for n, g in full_grad_dict(model, groups).items()}
        results.append((loss, grads))
    return results


@pytest.mark.slow
def test_packed_rows_give_the_same_loss_and_gradients_on_every_4_rank_grid(tmp_path):
    path = str(write_packed(tmp_path / "p", ROWS))
    ((ref_loss, ref_grads),) = run_world(_packed_step, 1, [Grid()], path)[0]
    grids = enumerate_grids(4)
    for results in run_world(_packed_step, 4, grids, path):
        for grid, (loss, grads) in zip(grids, results, strict=True):
            assert loss == pytest.approx(ref_loss, rel=1e-5), grid.describe()
            for name, expected in ref_grads.items():
                np.testing.assert_allclose(grads[name], expected, rtol=1e-4, atol=1e-7,
                                           err_msg=f"{grid.describe()} {name}")  # fmt: skip
