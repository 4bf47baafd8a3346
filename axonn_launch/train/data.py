"""Token sources and the sharded loaders (training and validation).

Sources (``TrainConfig.data``): ``shakespeare``, ``synthetic``, a token ``.bin``, or a
packed ``.bin`` with a ``.mask``. Micro-batches are ``MicroBatch(inputs, targets,
examples)``, int64, with ``targets == IGNORE_INDEX`` wherever a label does not count (a
mask byte of 0, or a label the Goldfish loss drops).

Each source, the splits and the windows: ``docs/data.md`` ("train/data.py").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch

from axonn_launch.common.grid import Coords, Grid
from axonn_launch.common.indexed import MASK_SUFFIX, read_index  # the index format (torch-free)
from axonn_launch.common.indexed import MEGATRON_DTYPES as MEGATRON_DTYPES  # re-exported
from axonn_launch.common.indexed import MEGATRON_IDX_HEADER as MEGATRON_IDX_HEADER
from axonn_launch.common.spec import GoldfishConfig, TrainConfig
from axonn_launch.common.tokenfile import dtype_for_vocab, read_layout
from axonn_launch.train.parallel.layers import IGNORE_INDEX as IGNORE_INDEX  # the loss's

SHAKESPEARE = Path(__file__).parent / "assets" / "tinyshakespeare.txt"
TRAIN_FRACTION = 0.9
BYTE_VOCAB = 256
MISSING = -1  # a context token before the start of the stream
EVAL_SEED = 0x5EED  # validation does not depend on the training seed
_MASK64 = (1 << 64) - 1


@dataclass
class Span:
    """One sequence's tokens and what the loader needs around them."""

    tokens: np.ndarray  # int64 [before + length]: ``before`` stream tokens first (MISSING: none)
    offsets: np.ndarray  # int64 [length]: each token's offset from its document's (packed:
    # its example's) first token
    keep: np.ndarray | None = None  # bool [length]: the token counts as a label; None: all
    examples: np.ndarray | None = None  # int64 [length]: packed example of each token; None: one


class MicroBatch(NamedTuple):
    """One micro-batch of this rank, each ``[rows, seq_len]`` int64."""

    inputs: torch.Tensor
    targets: torch.Tensor  # IGNORE_INDEX where a label does not count
    examples: torch.Tensor | None = None  # each input's packed example (None: one per row)


class TokenSource(Protocol):
    name: str
    vocab_size: int  # token ids are < vocab_size

    def window(self, number: int, length: int, seed: int) -> np.ndarray:
        """``length`` tokens for global sequence ``number``."""
        ...

    def span(
        self, number: int, length: int, seed: int, *, before: int = 0, ordered: bool = False
    ) -> Span:
        """The window with ``before`` preceding stream tokens, offsets and label mask;
        ``ordered``: sequences in stream order (validation), not hashed."""
        ...

    def check_length(self, length: int) -> None:
        """ValueError when this source cannot give sequences of ``length`` tokens."""
        ...


def splitmix64(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sequence_hash(seed: int, number: int) -> int:
    return splitmix64(splitmix64(seed & _MASK64) ^ number)


@dataclass
class ArraySource:
    """Windows of a 1-D token array (in memory or memory-mapped).

    ``starts``: the first token of each document, ascending, beginning with 0 (None: one
    document). ``mask``: one uint8 per token, 1 = counts as a label; a source with a mask
    is packed: its sequences are its documents. ``examples``: the first token of each
    example packed into them, ascending (None: one per document).
    """

    name: str
    tokens: np.ndarray
    vocab_size: int
    starts: np.ndarray | None = None
    mask: np.ndarray | None = None
    examples: np.ndarray | None = None
    _order: tuple = field(default=(), repr=False, compare=False)  # (seed, epoch, permutation)

    @property
    def packed(self) -> bool:
        return self.mask is not None

    def document_starts(self) -> np.ndarray:
        return np.zeros(1, np.int64) if self.starts is None else self.starts

    def check_length(self, length: int) -> None:
        if not self.packed:
            if len(self.tokens) < length:
                raise ValueError(f"{self.name}: {len(self.tokens)} tokens, need at least {length}")
            return
        sizes = np.diff(self.document_starts(), append=len(self.tokens))
        if not len(self.tokens) or (sizes != length).any():
            found = sorted(set(sizes.tolist()))[:3] if len(self.tokens) else "no"
            raise ValueError(
                f"{self.name}: packed sequences of {found} tokens, this run needs {length} "
                f"(train.seq_len={length - 1}; use the --seq-len the data was packed with)"
            )

    def window(self, number: int, length: int, seed: int) -> np.ndarray:
        return self.span(number, length, seed).tokens

    def span(
        self, number: int, length: int, seed: int, *, before: int = 0, ordered: bool = False
    ) -> Span:
        start = self.start(number, length, seed, ordered=ordered)
        first = max(start - before, 0)
        out = np.full(before + length, MISSING, dtype=np.int64)
        out[first - start + before :] = self.tokens[first : start + length]
        window = out[before:]
        if window.max(initial=0) >= self.vocab_size or window.min(initial=0) < 0:
            raise ValueError(f"{self.name}: token id outside [0, {self.vocab_size}) at {start}")
        at = np.arange(start, start + length)
        packing = self.packed and self.examples is not None
        firsts = self.examples if packing else self.document_starts()
        which = np.searchsorted(firsts, at, side="right") - 1
        offsets = at - firsts[which]
        keep = None if self.mask is None else self.mask[start : start + length].astype(bool)
        return Span(out, offsets, keep, which - which[0] if packing else None)

    def start(self, number: int, length: int, seed: int, *, ordered: bool = False) -> int:
        """First token of sequence ``number``: a document (packed), else a hashed offset;
        ``ordered``: consecutive documents, or windows sharing their boundary tokens."""
        if self.packed:
            starts = self.document_starts()
            index = number % len(starts)
            if not ordered:
                index = self._permutation(seed, number // len(starts))[index]
            return int(starts[index])
        self.check_length(length)
        positions = len(self.tokens) - length + 1
        if ordered:
            return number * (length - 1) % positions
        return sequence_hash(seed, number) % positions

    def _permutation(self, seed: int, epoch: int) -> np.ndarray:
        """The order of the documents in ``epoch`` (each epoch reads every one once)."""
        if self._order[:2] != (seed, epoch):
            rng = np.random.default_rng([seed & _MASK64, epoch])
            self._order = (seed, epoch, rng.permutation(len(self.document_starts())))
        return self._order[2]


@dataclass
class SyntheticSource:
    """Uniform random tokens; a pure function of (seed, sequence number). Each sequence is
    its own stream: no context before it, offsets from its first token."""

    vocab_size: int
    name: str = "synthetic"

    def check_length(self, length: int) -> None:
        pass

    def window(self, number: int, length: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng([seed & _MASK64, number])
        return rng.integers(0, self.vocab_size, size=length, dtype=np.int64)

    def span(
        self, number: int, length: int, seed: int, *, before: int = 0, ordered: bool = False
    ) -> Span:
        context = np.full(before, MISSING, np.int64)
        out = np.concatenate([context, self.window(number, length, seed)])
        return Span(out, np.arange(length, dtype=np.int64))


def open_source(data: str, *, model_vocab: int, split: str = "train") -> TokenSource:
    """The token source named by ``TrainConfig.data``; errors if its vocab exceeds the model's.
    ``split``: train (first 90%), val (the rest) or all (e.g. a separate validation file)."""
    if split not in ("train", "val", "all"):
        raise ValueError(f"split={split!r}: use train, val or all")
    if data == "synthetic":
        source: TokenSource = SyntheticSource(vocab_size=model_vocab)
    elif data == "shakespeare":
        source = _split(ArraySource("shakespeare", _shakespeare_tokens(), BYTE_VOCAB), split)
    else:
        source = _split(open_bin(Path(data), model_vocab=model_vocab), split)
    if source.vocab_size > model_vocab:
        raise ValueError(
            f"data {data!r} has vocab {source.vocab_size} but the model's vocab is {model_vocab}"
        )
    return source


def open_bin(path: Path, *, model_vocab: int) -> ArraySource:
    """A whole ``.bin`` with its ``.idx`` document starts and ``.mask`` when they exist."""
    tokens, vocab = read_bin(path, model_vocab=model_vocab)
    starts = document_starts(path, len(tokens))
    mask_path = path.with_suffix(MASK_SUFFIX)
    mask = None
    if mask_path.exists():
        mask = np.memmap(mask_path, dtype=np.uint8, mode="r")
        if starts is None or len(mask) != len(tokens):
            raise ValueError(
                f"{mask_path}: a label mask needs the .idx of its packed sequences and one "
                f"byte per token of {path.name} ({len(tokens)}); found {len(mask)} bytes"
            )
    examples = sequence_starts(path) if mask is not None else None
    return ArraySource(path.name, tokens, vocab, starts, mask, examples)


def document_starts(path: Path, tokens: int) -> np.ndarray | None:
    """First token of each document of a ``.bin`` from its ``.idx``, beginning with 0;
    None without an index or when the index lists no sequences."""
    idx = path.with_suffix(".idx")
    if not idx.exists():
        return None
    index = read_index(idx)
    if not len(index.sizes):
        return None
    if index.tokens != tokens:
        raise ValueError(f"{idx} indexes {index.tokens} tokens but {path} holds {tokens}")
    return np.union1d([0], index.document_starts()).astype(np.int64)


def sequence_starts(path: Path) -> np.ndarray | None:
    """First token of each ``.idx`` sequence of a ``.bin`` when some document holds more
    than one (packed examples), else None."""
    index = read_index(path.with_suffix(".idx"))
    if len(index.doc_indices) - 1 >= len(index.sizes):
        return None
    return index.sequence_starts()


def _shakespeare_tokens() -> np.ndarray:
    return np.frombuffer(SHAKESPEARE.read_bytes(), dtype=np.uint8)


def _split(whole: ArraySource, split: str) -> ArraySource:
    """The first 90% of the tokens (packed: of the documents) is train, the rest val."""
    if split == "all":
        return whole
    cut = _split_point(whole)
    low, high = (0, cut) if split == "train" else (cut, len(whole.tokens))
    starts, examples = (_inside(firsts, low, high) for firsts in (whole.starts, whole.examples))
    mask = None if whole.mask is None else whole.mask[low:high]
    name = f"{whole.name}:{split}"
    return ArraySource(name, whole.tokens[low:high], whole.vocab_size, starts, mask, examples)


def _inside(firsts: np.ndarray | None, low: int, high: int) -> np.ndarray | None:
    """The first tokens in ``[low, high)``, counted from ``low``, beginning with 0."""
    if firsts is None:
        return None
    inside = firsts[(firsts >= low) & (firsts < high)]
    return np.union1d([0], inside - low).astype(np.int64)


def _split_point(whole: ArraySource) -> int:
    if not whole.packed:
        return int(len(whole.tokens) * TRAIN_FRACTION)
    starts = whole.document_starts()
    train_docs = max(int(len(starts) * TRAIN_FRACTION), 1)
    return int(starts[train_docs]) if train_docs < len(starts) else len(whole.tokens)


def bin_dtype(path: Path, *, model_vocab: int) -> tuple[np.dtype, int]:
    """(dtype, vocab bound) of a token ``.bin``, by ``tokenfile.read_layout``'s rules."""
    layout = read_layout(path, model_vocab)
    return np.dtype(layout.dtype), layout.vocab


def read_bin(path: Path, *, model_vocab: int) -> tuple[np.ndarray, int]:
    """Memory-map a token ``.bin``; returns (tokens, vocab bound)."""
    if not path.exists():
        raise FileNotFoundError(f"token file {path} does not exist")
    dtype, vocab = bin_dtype(path, model_vocab=model_vocab)
    return np.memmap(path, dtype=dtype, mode="r"), vocab


def write_bin(path: Path, tokens: np.ndarray, *, vocab_size: int) -> None:
    """Write tokens as a ``.bin`` plus its JSON sidecar (uint16 if the vocab allows)."""
    dtype = np.dtype(dtype_for_vocab(vocab_size))
    np.asarray(tokens, dtype=dtype).tofile(path)
    meta = {"dtype": np.dtype(dtype).name, "vocab_size": vocab_size}
    path.with_name(path.name + ".json").write_text(json.dumps(meta))


@dataclass(frozen=True)
class Geometry:
    """Which sequences this rank reads: the grid, its place in it, and the step's shape.

    For optimizer step t and micro-step m, local row r of the rank at data index d and z
    index zz reads global sequence ``t * global_batch + i`` with
    ``i = m*(micro_batch*data) + d*micro_batch + zz*(micro_batch//z) + r``.
    """

    grid: Grid
    coords: Coords
    micro_batch: int
    seq_len: int
    accumulation: int

    def __post_init__(self) -> None:
        if self.micro_batch % self.grid.z:
            raise ValueError(
                f"micro_batch={self.micro_batch} is not divisible by grid.z={self.grid.z}"
            )

    @classmethod
    def of(cls, train: TrainConfig, grid: Grid, coords: Coords) -> Geometry:
        """The job's geometry: ``train``'s shape on ``grid`` at ``coords``."""
        return cls(grid, coords, train.micro_batch, train.seq_len, train.accumulation_steps(grid))

    @property
    def local_rows(self) -> int:
        return self.micro_batch // self.grid.z

    @property
    def global_batch(self) -> int:
        return self.accumulation * self.micro_batch * self.grid.data

    def sequence_numbers(self, step: int, micro: int) -> list[int]:
        base = (
            step * self.global_batch
            + micro * self.micro_batch * self.grid.data
            + self.coords.data * self.micro_batch
            + self.coords.z * self.local_rows
        )
        return [base + r for r in range(self.local_rows)]


class Loader:
    """This rank's micro-batches (the rows its ``Geometry`` names); ranks of one x*y plane
    get the same sequences.

    ``goldfish`` (k > 0) drops labels from the loss with ``goldfish.keep_mask``, given each
    label's ``h - 1`` preceding stream labels and its position in its document (offset
    from the document's first token, minus 1). The mask is computed on the CPU, so it is
    the same on every device.
    """

    ordered = False  # sequences in hashed order (EvalLoader: in stream order)

    def __init__(
        self,
        source: TokenSource,
        geometry: Geometry,
        *,
        seed: int,
        device: torch.device | str = "cpu",
        goldfish: GoldfishConfig | None = None,
    ) -> None:
        source.check_length(geometry.seq_len + 1)
        self.source = source
        self.geometry = geometry
        self.seq_len = geometry.seq_len
        self.accumulation = geometry.accumulation
        self.seed = seed
        self.device = torch.device(device)
        self.goldfish = goldfish if goldfish is not None and goldfish.k > 0 else None
        self.step = 0  # next optimizer step to load

    @property
    def context(self) -> int:
        """Stream tokens read before each window: the Goldfish hash's ``h - 1``."""
        return self.goldfish.h - 1 if self.goldfish else 0

    def sequence_numbers(self, step: int, micro: int) -> list[int]:
        return self.geometry.sequence_numbers(step, micro)

    def batch(self, step: int, micro: int) -> MicroBatch:
        """Inputs, targets and packed examples, each ``[micro_batch // z, seq_len]``."""
        spans = [
            self.source.span(n, self.seq_len + 1, self.seed, before=self.context,
                             ordered=self.ordered)
            for n in self.sequence_numbers(step, micro)
        ]  # fmt: skip
        rows = torch.from_numpy(np.stack([s.tokens for s in spans]))
        inputs, targets = rows[:, self.context : -1], rows[:, self.context + 1 :]
        keep = self._keep(spans, rows)
        if keep is not None:
            targets = targets.masked_fill(~keep, IGNORE_INDEX)
        examples = self._examples(spans)
        if self.device.type == "cuda":
            inputs, targets, examples = (
                t if t is None else t.pin_memory().to(self.device, non_blocking=True)
                for t in (inputs, targets, examples)
            )
        return MicroBatch(inputs, targets, examples)

    def _examples(self, spans: list[Span]) -> torch.Tensor | None:
        """``[rows, seq_len]`` example number of each input token; None when every row
        is one example (plain causal attention)."""
        if all(s.examples is None or s.examples[-2] == 0 for s in spans):
            return None
        zeros = np.zeros(self.seq_len + 1, np.int64)
        rows = [zeros if s.examples is None else s.examples for s in spans]
        return torch.from_numpy(np.stack(rows)[:, :-1])

    def _keep(self, spans: list[Span], rows: torch.Tensor) -> torch.Tensor | None:
        """Bool ``[rows, seq_len]``: the labels that count (None: all of them)."""
        keep = None
        if any(s.keep is not None for s in spans):
            ones = np.ones(self.seq_len + 1, dtype=bool)
            masks = [ones if s.keep is None else s.keep for s in spans]
            keep = torch.from_numpy(np.stack(masks)[:, 1:])
        if self.goldfish is None:
            return keep
        from axonn_launch.train.goldfish import keep_mask  # imported only when used

        positions = torch.from_numpy(np.stack([s.offsets[1:] - 1 for s in spans]))
        g = self.goldfish
        dropped = keep_mask(rows[:, 1:], positions, g.k, g.h, g.strategy)
        return dropped if keep is None else keep & dropped

    def next_step(self) -> list[MicroBatch]:
        """All micro-batches of the next optimizer step; advances the position."""
        batches = [self.batch(self.step, m) for m in range(self.accumulation)]
        self.step += 1
        return batches

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "source": self.source.name}

    def load_state_dict(self, state: dict) -> None:
        if state["source"] != self.source.name or state["seed"] != self.seed:
            raise ValueError(
                f"loader state is for {state['source']} seed {state['seed']}, "
                f"this loader reads {self.source.name} seed {self.seed}"
            )
        self.step = int(state["step"])


class EvalLoader(Loader):
    """``batches`` global batches of validation data, the same every time: sequences in
    stream order (packed: documents in order; else consecutive windows), sharded exactly
    as training batches (one x*y plane shares rows; z and data split them), targets
    IGNORE_INDEX where a mask says so, never a Goldfish drop. Iterating yields every
    micro-batch of every batch: ``batches * accumulation`` of them."""

    ordered = True

    def __init__(
        self,
        source: TokenSource,
        geometry: Geometry,
        *,
        batches: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if batches < 1:
            raise ValueError(f"batches={batches}: an evaluation needs at least one batch")
        super().__init__(source, geometry, seed=EVAL_SEED, device=device)
        self.batches = batches

    def __len__(self) -> int:
        return self.batches * self.accumulation

    def __iter__(self) -> Iterator[MicroBatch]:
        for step in range(self.batches):
            for micro in range(self.accumulation):
                yield self.batch(step, micro)
