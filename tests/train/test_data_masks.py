"""The loader's label conventions: document boundaries from ``.idx``, packed sources with a
``.mask`` (whole aligned sequences, -100 where the mask is 0), the Goldfish context and
positions (against ``keep_mask`` run on the whole stream), and the validation loader's
sharding (the union of a simulated grid's rows is the single-rank batch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from axonn_launch.common.grid import Grid
from axonn_launch.common.indexed import IndexedWriter, token_dtype
from axonn_launch.common.spec import GoldfishConfig
from axonn_launch.train.data import (
    IGNORE_INDEX,
    EvalLoader,
    Geometry,
    Loader,
    open_source,
)

GRIDS = [Grid(), Grid(x=2, z=2), Grid(data=2, z=2), Grid(data=2, x=2, y=2, z=2)]
SEQ = 16
VOCAB = 1000


def write_docs(prefix: Path, docs: list[np.ndarray], masks: list[np.ndarray] | None = None) -> Path:
    """``prefix``.bin/.idx (+ .mask) through the same writer as ``axonn_launch.data``."""
    with IndexedWriter(prefix, token_dtype(VOCAB), masked=masks is not None) as writer:
        for i, doc in enumerate(docs):
            writer.add(doc, [len(doc)], None if masks is None else masks[i])
        writer.commit({"vocab_size": VOCAB})
    return prefix.with_name(prefix.name + ".bin")


def random_docs(count: int, *, low: int = 5, high: int = 60, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(low, high))) for _ in range(count)]


def loader(source, grid=GRIDS[0], rank=0, *, micro_batch=4, accumulation=2, goldfish=None):
    geometry = Geometry(grid, grid.coords(rank), micro_batch, SEQ, accumulation)
    return Loader(source, geometry, seed=3, goldfish=goldfish)


def offsets(load: Loader, step: int, micro: int, inputs: torch.Tensor, stream) -> list[int]:
    """Each row's offset in ``stream``, checked against the row's tokens."""
    starts = [load.source.start(n, SEQ + 1, load.seed) for n in load.sequence_numbers(step, micro)]
    for s, row in zip(starts, inputs.numpy()):
        np.testing.assert_array_equal(stream[s : s + SEQ], row)
    return starts


def test_document_starts_come_from_the_idx(tmp_path):
    docs = random_docs(40)
    path = write_docs(tmp_path / "d", docs)
    starts = np.cumsum([0, *[len(d) for d in docs[:-1]]])
    whole = sum(len(d) for d in docs)
    train = open_source(str(path), model_vocab=VOCAB)
    assert train.starts.tolist() == [s for s in starts if s < int(whole * 0.9)]
    val = open_source(str(path), model_vocab=VOCAB, split="val")
    cut = int(whole * 0.9)
    assert val.starts.tolist() == [0, *[s - cut for s in starts if s > cut]]
    assert not train.packed and train.mask is None
    everything = open_source(str(path), model_vocab=VOCAB, split="all")
    assert everything.starts.tolist() == starts.tolist() and len(everything.tokens) == whole


# ------------------------------------------------------------------ packed sources


def packed_dataset(tmp_path: Path, count: int = 20) -> tuple[Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, size=(count, SEQ + 1))
    masks = (rng.random((count, SEQ + 1)) < 0.6).astype(np.uint8)
    return write_docs(tmp_path / "p", list(tokens), list(masks)), tokens, masks


def test_packed_windows_are_whole_sequences_with_minus_100_where_masked(tmp_path):
    path, tokens, masks = packed_dataset(tmp_path)
    source = open_source(str(path), model_vocab=VOCAB)
    assert source.packed and len(source.starts) == 18  # 90% of the 20 sequences
    seen = []
    load = loader(source, micro_batch=6, accumulation=1)
    for step in range(3):  # 3 batches of 6 = one epoch of 18 sequences
        x, y, _ = load.batch(step, 0)
        for row_x, row_y in zip(x.numpy(), y.numpy()):
            doc = next(i for i in range(18) if np.array_equal(tokens[i, :-1], row_x))
            expected = np.where(masks[doc, 1:] == 1, tokens[doc, 1:], IGNORE_INDEX)
            np.testing.assert_array_equal(row_y, expected)
            seen.append(doc)
        assert x.dtype == y.dtype == torch.int64
    assert sorted(seen) == list(range(18)), "each packed sequence once per epoch"


def test_packed_data_needs_its_seq_len(tmp_path):
    path, _, _ = packed_dataset(tmp_path)
    with pytest.raises(ValueError, match="seq_len=8"):
        geometry = Geometry(Grid(), Grid().coords(0), micro_batch=1, seq_len=8, accumulation=1)
        Loader(open_source(str(path), model_vocab=VOCAB), geometry, seed=0)


def test_mask_without_index_is_rejected(tmp_path):
    path, _, _ = packed_dataset(tmp_path)
    path.with_suffix(".idx").unlink()
    path.with_name("p.bin.json").write_text('{"dtype": "uint16", "vocab_size": 1000}')
    with pytest.raises(ValueError, match="needs the .idx"):
        open_source(str(path), model_vocab=VOCAB)


def test_packed_loader_state_resumes(tmp_path):
    path, _, _ = packed_dataset(tmp_path, count=30)
    source = open_source(str(path), model_vocab=VOCAB)
    reference = loader(source, Grid(data=2), 1)
    expected = [reference.next_step() for _ in range(6)]  # crosses epochs
    resumed = loader(open_source(str(path), model_vocab=VOCAB), Grid(data=2), 1)
    resumed.load_state_dict({**reference.state_dict(), "step": 4})
    for want in expected[4:]:
        for (ex, ey, _), (gx, gy, _) in zip(want, resumed.next_step()):
            assert torch.equal(ex, gx) and torch.equal(ey, gy)


# ------------------------------------------------------------------ Goldfish plumbing


def stream_keep(stream: np.ndarray, doc_starts: list[int], cfg: GoldfishConfig) -> np.ndarray:
    """keep_mask on the whole stream as one row: entry j - 1 is label j's verdict."""
    from axonn_launch.train.goldfish import keep_mask

    labels_ext = np.concatenate([np.full(cfg.h - 1, -1), stream])[1:]
    at = np.arange(1, len(stream))
    first = np.array(doc_starts)[np.searchsorted(doc_starts, at, side="right") - 1]
    positions = torch.from_numpy(at - first - 1)[None]
    keep = keep_mask(torch.from_numpy(labels_ext)[None], positions, cfg.k, cfg.h, cfg.strategy)
    return keep[0].numpy()


@pytest.mark.parametrize("strategy", ["hash-table", "hash-avalanche", "static"])
def test_goldfish_masks_equal_keep_mask_on_the_full_stream(tmp_path, strategy):
    pytest.importorskip("axonn_launch.train.goldfish")
    docs = random_docs(60, seed=2)
    path = write_docs(tmp_path / "g", docs)
    stream = np.concatenate(docs)
    starts = np.cumsum([0, *[len(d) for d in docs[:-1]]]).tolist()
    cfg = GoldfishConfig(k=3, h=4, strategy=strategy)
    keep = stream_keep(stream, starts, cfg)
    source = open_source(str(path), model_vocab=VOCAB)
    plain, fish = loader(source), loader(source, goldfish=cfg)
    dropped = 0
    for step in range(4):
        (x0, y0, _), (x, y, _) = plain.batch(step, 1), fish.batch(step, 1)
        assert torch.equal(x0, x)
        for s, row_y, row_plain in zip(offsets(fish, step, 1, x, stream), y.numpy(), y0.numpy()):
            expected = np.where(keep[s : s + SEQ], stream[s + 1 : s + SEQ + 1], IGNORE_INDEX)
            np.testing.assert_array_equal(row_y, expected)
            np.testing.assert_array_equal(row_plain, stream[s + 1 : s + SEQ + 1])
            dropped += int((row_y == IGNORE_INDEX).sum())
    assert 0 < dropped < 4 * 4 * SEQ


def test_goldfish_static_counts_positions_from_the_stream_start_without_an_index():
    pytest.importorskip("axonn_launch.train.goldfish")
    source = open_source("shakespeare", model_vocab=256)
    corpus = np.asarray(source.tokens, dtype=np.int64)
    cfg = GoldfishConfig(k=5, h=4, strategy="static")
    load = loader(source, goldfish=cfg)
    x, y, _ = load.batch(7, 0)
    for s, row_y in zip(offsets(load, 7, 0, x, corpus), y.numpy()):
        position = s + np.arange(SEQ)  # label s + 1 + i sits at index s + i of its targets
        expected = np.where(position % 5 == 0, IGNORE_INDEX, corpus[s + 1 : s + SEQ + 1])
        np.testing.assert_array_equal(row_y, expected)


def test_goldfish_combines_with_a_packed_mask(tmp_path):
    pytest.importorskip("axonn_launch.train.goldfish")
    path, tokens, masks = packed_dataset(tmp_path)
    source = open_source(str(path), model_vocab=VOCAB)
    cfg = GoldfishConfig(k=4, h=2, strategy="static")
    x, y, _ = loader(source, goldfish=cfg, micro_batch=6, accumulation=1).batch(0, 0)
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        doc = next(i for i in range(18) if np.array_equal(tokens[i, :-1], row_x))
        counts = (masks[doc, 1:] == 1) & (np.arange(SEQ) % 4 != 0)  # aligned: position = index
        np.testing.assert_array_equal(row_y, np.where(counts, tokens[doc, 1:], IGNORE_INDEX))


def test_goldfish_off_reads_no_context_and_changes_nothing():
    source = open_source("shakespeare", model_vocab=256)
    off = loader(source, goldfish=GoldfishConfig(k=0))
    assert off.context == 0
    a, b = off.batch(2, 1), loader(source).batch(2, 1)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert a.examples is b.examples is None


# ------------------------------------------------------------------ validation


def eval_loader(source, grid: Grid, rank: int, *, micro_batch=4, accumulation=2, batches=3):
    geometry = Geometry(grid, grid.coords(rank), micro_batch, SEQ, accumulation)
    return EvalLoader(source, geometry, batches=batches)


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.describe())
@pytest.mark.parametrize("data", ["shakespeare", "packed"])
def test_eval_shards_union_to_the_single_rank_batches(grid, data, tmp_path):
    path = packed_dataset(tmp_path, count=40)[0] if data == "packed" else None
    source = open_source(str(path) if path else "shakespeare", model_vocab=VOCAB, split="val")
    accumulation, micro = 2, 4
    global_batch = accumulation * micro * grid.data
    single = eval_loader(source, Grid(), 0, micro_batch=global_batch, accumulation=1)
    reference = [b for b in single]  # one micro-batch = one global batch
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for rank in range(grid.world_size):
        load = eval_loader(source, grid, rank, micro_batch=micro, accumulation=accumulation)
        assert len(load) == 3 * accumulation
        batches = iter(load)
        for step in range(3):
            for m in range(accumulation):
                x, y, _ = next(batches)
                for r, number in enumerate(load.sequence_numbers(step, m)):
                    if number in rows:  # a plane member: the same row
                        assert torch.equal(rows[number][0], x[r])
                        assert torch.equal(rows[number][1], y[r])
                    rows[number] = (x[r], y[r])
    assert sorted(rows) == list(range(3 * global_batch))
    for number, (x, y) in rows.items():
        ref_x, ref_y, _ = reference[number // global_batch]
        assert torch.equal(x, ref_x[number % global_batch])
        assert torch.equal(y, ref_y[number % global_batch])
    if data == "packed":
        assert any((y == IGNORE_INDEX).any() for _, y in rows.values())


def test_eval_is_deterministic_ordered_and_ignores_the_training_seed():
    source = open_source("shakespeare", model_vocab=256, split="val")
    a = [b for b in eval_loader(source, Grid(), 0)]
    b = [b for b in eval_loader(source, Grid(), 0)]
    assert all(torch.equal(p[1], q[1]) for p, q in zip(a, b))
    x, y, _ = a[0]
    val = np.asarray(source.tokens, dtype=np.int64)
    for r in range(4):  # sequence r: the window at r * seq_len, its labels the next tokens
        np.testing.assert_array_equal(x[r].numpy(), val[r * SEQ : (r + 1) * SEQ])
        np.testing.assert_array_equal(y[r].numpy(), val[r * SEQ + 1 : (r + 1) * SEQ + 1])
