"""Token sources and the sharded loader.

Sources (``TrainConfig.data``):

- ``shakespeare``: the built-in corpus shipped in ``train/data/``, byte-level tokens
  (vocab 256); the first 90% of the bytes is the train split, the rest validation.
- ``synthetic``: uniformly random tokens over the model's vocab, for benchmarks.
- a path to a ``.bin`` file: a flat stream of token ids (nanoGPT / Megatron convention),
  memory-mapped. Its dtype comes from, in order: a Megatron ``.idx`` next to it (same stem;
  its header's dtype code), a JSON sidecar ``<file>.json`` such as
  ``{"dtype": "uint16", "vocab_size": 50257}`` (what ``write_bin`` writes), or else the
  model's vocab size (uint16 up to 65536 tokens, uint32 above). Document boundaries in
  an ``.idx`` are ignored: the file is read as one token stream, as nanoGPT does.

Every training sequence is a window of ``seq_len + 1`` tokens at an offset that is a
hash of (seed, global sequence number), so each rank reads only its own windows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from axonn_launch.grid import Coords, Grid

SHAKESPEARE = Path(__file__).parent / "data" / "tinyshakespeare.txt"
TRAIN_FRACTION = 0.9
BYTE_VOCAB = 256
MEGATRON_IDX_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_MASK64 = (1 << 64) - 1


class TokenSource(Protocol):
    name: str
    vocab_size: int  # token ids are < vocab_size

    def window(self, number: int, length: int, seed: int) -> np.ndarray:
        """``length`` tokens for global sequence ``number``."""
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
    """Windows of a 1-D token array (in memory or memory-mapped)."""

    name: str
    tokens: np.ndarray
    vocab_size: int

    def window(self, number: int, length: int, seed: int) -> np.ndarray:
        positions = len(self.tokens) - length + 1
        if positions < 1:
            raise ValueError(f"{self.name}: {len(self.tokens)} tokens, need at least {length}")
        start = sequence_hash(seed, number) % positions
        out = np.asarray(self.tokens[start : start + length], dtype=np.int64)
        if out.max(initial=0) >= self.vocab_size or out.min(initial=0) < 0:
            raise ValueError(f"{self.name}: token id outside [0, {self.vocab_size}) at {start}")
        return out


@dataclass
class SyntheticSource:
    """Uniform random tokens; a pure function of (seed, sequence number)."""

    vocab_size: int
    name: str = "synthetic"

    def window(self, number: int, length: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng([seed & _MASK64, number])
        return rng.integers(0, self.vocab_size, size=length, dtype=np.int64)


def open_source(data: str, *, model_vocab: int, split: str = "train") -> TokenSource:
    """The token source named by ``TrainConfig.data``; errors if its vocab exceeds the model's."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}: use train or val")
    if data == "synthetic":
        source: TokenSource = SyntheticSource(vocab_size=model_vocab)
    elif data == "shakespeare":
        source = _split(_shakespeare_tokens(), split, "shakespeare", BYTE_VOCAB)
    else:
        tokens, vocab = read_bin(Path(data), model_vocab=model_vocab)
        source = _split(tokens, split, Path(data).name, vocab)
    if source.vocab_size > model_vocab:
        raise ValueError(
            f"data {data!r} has vocab {source.vocab_size} but the model's vocab is {model_vocab}"
        )
    return source


def _shakespeare_tokens() -> np.ndarray:
    return np.frombuffer(SHAKESPEARE.read_bytes(), dtype=np.uint8)


def _split(tokens: np.ndarray, split: str, name: str, vocab: int) -> ArraySource:
    cut = int(len(tokens) * TRAIN_FRACTION)
    part = tokens[:cut] if split == "train" else tokens[cut:]
    return ArraySource(name=f"{name}:{split}", tokens=part, vocab_size=vocab)


def bin_dtype(path: Path, *, model_vocab: int) -> tuple[np.dtype, int]:
    """(dtype, vocab bound) of a token ``.bin``: from ``.idx``, JSON sidecar, or vocab size."""
    idx = path.with_suffix(".idx")
    sidecar = path.with_name(path.name + ".json")
    if idx.exists():
        return np.dtype(_megatron_idx_dtype(idx)), model_vocab
    if sidecar.exists():
        meta = json.loads(sidecar.read_text())
        return np.dtype(meta["dtype"]), int(meta.get("vocab_size", model_vocab))
    return np.dtype(np.uint16 if model_vocab <= 2**16 else np.uint32), model_vocab


def _megatron_idx_dtype(idx: Path) -> type:
    with idx.open("rb") as f:
        header = f.read(len(MEGATRON_IDX_HEADER) + 8 + 1)
    if not header.startswith(MEGATRON_IDX_HEADER) or len(header) < 18:
        raise ValueError(f"{idx}: not a Megatron index file")
    code = header[-1]
    if code not in MEGATRON_DTYPES:
        raise ValueError(f"{idx}: unsupported token dtype code {code}")
    return MEGATRON_DTYPES[code]


def read_bin(path: Path, *, model_vocab: int) -> tuple[np.ndarray, int]:
    """Memory-map a token ``.bin``; returns (tokens, vocab bound)."""
    if not path.exists():
        raise FileNotFoundError(f"token file {path} does not exist")
    dtype, vocab = bin_dtype(path, model_vocab=model_vocab)
    return np.memmap(path, dtype=dtype, mode="r"), vocab


def write_bin(path: Path, tokens: np.ndarray, *, vocab_size: int) -> None:
    """Write tokens as a ``.bin`` plus its JSON sidecar (uint16 if the vocab allows)."""
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    np.asarray(tokens, dtype=dtype).tofile(path)
    meta = {"dtype": np.dtype(dtype).name, "vocab_size": vocab_size}
    path.with_name(path.name + ".json").write_text(json.dumps(meta))


class Loader:
    """This rank's micro-batches; ranks of one x*y plane get the same sequences.

    For optimizer step t and micro-step m, local row r of the rank at data index d and z
    index zz reads global sequence ``t * global_batch + i`` with
    ``i = m*(micro_batch*data) + d*micro_batch + zz*(micro_batch//z) + r``.
    """

    def __init__(
        self,
        source: TokenSource,
        *,
        grid: Grid,
        coords: Coords,
        micro_batch: int,
        seq_len: int,
        accumulation: int,
        seed: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if micro_batch % grid.z:
            raise ValueError(f"micro_batch={micro_batch} is not divisible by grid.z={grid.z}")
        self.source = source
        self.grid = grid
        self.coords = coords
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.accumulation = accumulation
        self.seed = seed
        self.device = torch.device(device)
        self.step = 0  # next optimizer step to load

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

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``[micro_batch // z, seq_len]`` int64."""
        windows = [
            self.source.window(n, self.seq_len + 1, self.seed)
            for n in self.sequence_numbers(step, micro)
        ]
        rows = torch.from_numpy(np.stack(windows))
        if self.device.type == "cuda":
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
