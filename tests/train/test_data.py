"""Token sources and the sharded loader: disjoint and covering shards, determinism, state."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from axonn_launch.common.grid import Coords, Grid
from axonn_launch.train.data import (
    SHAKESPEARE,
    Geometry,
    Loader,
    bin_dtype,
    open_source,
    read_bin,
    write_bin,
)

GRIDS = [Grid(), Grid(x=2, z=2), Grid(data=2, z=2), Grid(data=2, x=2, y=2, z=2), Grid(data=4)]


def make_loader(grid: Grid, rank: int, *, source=None, micro_batch=4, accumulation=2, seed=7):
    return Loader(
        source or open_source("shakespeare", model_vocab=256),
        Geometry(grid, grid.coords(rank), micro_batch, seq_len=16, accumulation=accumulation),
        seed=seed,
    )


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.describe())
def test_shards_are_disjoint_and_cover_the_global_batch(grid):
    accumulation = 2
    planes: dict[tuple[int, int], list[int]] = {}
    for rank in range(grid.world_size):
        loader = make_loader(grid, rank, accumulation=accumulation)
        c = grid.coords(rank)
        numbers = [n for m in range(accumulation) for n in loader.sequence_numbers(3, m)]
        planes.setdefault((c.data, c.z), numbers)
        assert planes[(c.data, c.z)] == numbers, "ranks of one x*y plane must share sequences"
    everything = sorted(n for numbers in planes.values() for n in numbers)
    global_batch = accumulation * 4 * grid.data
    assert everything == list(range(3 * global_batch, 4 * global_batch))


def test_sequence_number_formula():
    grid = Grid(data=2, x=2, z=2)
    loader = make_loader(grid, grid.rank(Coords(x=1, y=0, z=1, data=1)))
    # i = m*(micro_batch*data) + d*micro_batch + zz*(micro_batch//z) + r, with step offset
    step, micro = 5, 1
    expected = [5 * 16 + 1 * 8 + 1 * 4 + 1 * 2 + r for r in range(2)]
    assert loader.sequence_numbers(step, micro) == expected


def test_plane_members_get_identical_tensors_and_planes_differ():
    grid = Grid(x=2, y=2, z=2)
    batches = [make_loader(grid, r).batch(0, 0) for r in range(grid.world_size)]
    for rank in range(1, 4):
        assert torch.equal(batches[0][0], batches[rank][0])
    assert not torch.equal(batches[0][0], batches[4][0])
    x, y, examples = batches[0]
    assert examples is None  # unpacked: plain causal attention
    assert x.shape == (2, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_windows_are_slices_of_the_corpus():
    x, y, _ = make_loader(Grid(), 0).batch(2, 1)
    corpus = SHAKESPEARE.read_bytes()
    for row_x, row_y in zip(x, y, strict=True):
        text = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
        assert text in corpus[: int(len(corpus) * 0.9)]


def test_determinism_and_seed_dependence():
    a = make_loader(Grid(z=2), 0).batch(4, 1)[0]
    b = make_loader(Grid(z=2), 0).batch(4, 1)[0]
    c = make_loader(Grid(z=2), 0, seed=8).batch(4, 1)[0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_state_restore_continues_the_same_stream():
    reference = make_loader(Grid(data=2), 1)
    batches = [reference.next_step() for _ in range(5)]
    first = make_loader(Grid(data=2), 1)
    for _ in range(3):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make_loader(Grid(data=2), 1)
    resumed.load_state_dict(state)
    for expected in batches[3:]:
        for (ex, ey, _), (gx, gy, _) in zip(expected, resumed.next_step(), strict=True):
            assert torch.equal(ex, gx) and torch.equal(ey, gy)


def test_state_from_another_seed_is_rejected():
    state = make_loader(Grid(), 0, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        make_loader(Grid(), 0, seed=2).load_state_dict(state)


def test_splits_are_90_10_and_disjoint():
    train = open_source("shakespeare", model_vocab=256, split="train")
    val = open_source("shakespeare", model_vocab=256, split="val")
    total = len(SHAKESPEARE.read_bytes())
    assert len(train.tokens) + len(val.tokens) == total
    assert len(train.tokens) == int(total * 0.9)


def test_data_vocab_must_fit_model():
    with pytest.raises(ValueError, match="vocab"):
        open_source("shakespeare", model_vocab=128)


def test_synthetic_tokens_stay_in_vocab_and_are_deterministic():
    source = open_source("synthetic", model_vocab=50)
    a = make_loader(Grid(z=2), 1, source=source).batch(0, 0)[0]
    b = make_loader(Grid(z=2), 1, source=source).batch(0, 0)[0]
    assert torch.equal(a, b)
    assert int(a.max()) < 50 and int(a.min()) >= 0
    assert len(torch.unique(a)) > 10


@pytest.mark.parametrize("vocab", [1000, 70000])
def test_bin_memmap_round_trip(tmp_path, vocab):
    tokens = np.random.default_rng(0).integers(0, vocab, size=5000)
    path = tmp_path / "tokens.bin"
    write_bin(path, tokens, vocab_size=vocab)
    assert path.stat().st_size == 5000 * (2 if vocab <= 65536 else 4)
    read, bound = read_bin(path, model_vocab=vocab)
    assert isinstance(read, np.memmap)
    assert bound == vocab
    np.testing.assert_array_equal(read, tokens)
    source = open_source(str(path), model_vocab=vocab)
    x, y, _ = make_loader(Grid(), 0, source=source).batch(0, 0)
    row = x[0].numpy()
    start = next(i for i in range(len(tokens)) if np.array_equal(tokens[i : i + 16], row))
    np.testing.assert_array_equal(y[0].numpy(), tokens[start + 1 : start + 17])


def test_bin_without_sidecar_uses_model_vocab(tmp_path):
    path = tmp_path / "raw.bin"
    np.arange(100, dtype=np.uint32).tofile(path)
    assert bin_dtype(path, model_vocab=100_000)[0] == np.uint32
    assert bin_dtype(path, model_vocab=50_000)[0] == np.uint16


def test_bin_dtype_from_megatron_idx(tmp_path):
    path = tmp_path / "corpus_text_document.bin"
    np.arange(100, dtype=np.int32).tofile(path)
    header = b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([4])
    path.with_suffix(".idx").write_bytes(header + b"\x00" * 16)
    assert bin_dtype(path, model_vocab=50_000)[0] == np.int32
    tokens, _ = read_bin(path, model_vocab=50_000)
    np.testing.assert_array_equal(tokens, np.arange(100))


def test_bin_sidecar_vocab_larger_than_model_is_rejected(tmp_path):
    path = tmp_path / "big.bin"
    write_bin(path, np.arange(10), vocab_size=50257)
    with pytest.raises(ValueError, match="vocab"):
        open_source(str(path), model_vocab=256)


def test_out_of_vocab_tokens_are_caught_when_read(tmp_path):
    path = tmp_path / "bad.bin"
    np.full(100, 300, dtype=np.uint16).tofile(path)
    source = open_source(str(path), model_vocab=256)
    with pytest.raises(ValueError, match="outside"):
        make_loader(Grid(), 0, source=source).batch(0, 0)


def test_micro_batch_must_divide_over_z():
    with pytest.raises(ValueError, match="divisible"):
        make_loader(Grid(z=3), 0)


def test_sidecar_vocab_applies_beside_a_megatron_idx(tmp_path):
    from axonn_launch.common.indexed import IndexedWriter, token_dtype

    prefix = tmp_path / "corpus"
    with IndexedWriter(prefix, token_dtype(50257)) as writer:
        writer.add(np.arange(40), [10, 30])
        writer.commit({"vocab_size": 50257})
    path = tmp_path / "corpus.bin"
    assert bin_dtype(path, model_vocab=60000) == (np.dtype(np.uint16), 50257)
    with pytest.raises(ValueError, match="vocab 50257"):
        open_source(str(path), model_vocab=256)
    assert open_source(str(path), model_vocab=50257).starts.tolist() == [0, 10]
