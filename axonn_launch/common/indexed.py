"""Megatron's indexed token format (``MMapIndexedDataset``): ``PREFIX.bin`` holds the tokens,
``PREFIX.idx`` the sequence sizes, their byte offsets and the first sequence of each document.
The data command writes it and the job reads it; numpy only, no torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from axonn_launch.common.tokenfile import MEGATRON_DTYPE_NAMES, MEGATRON_IDX_HEADER

MEGATRON_IDX_VERSION = 1
MEGATRON_DTYPES = {code: getattr(np, name) for code, name in MEGATRON_DTYPE_NAMES.items()}
MASK_SUFFIX = ".mask"  # uint8 per token beside PREFIX.bin: 1 = the token counts as a label


@dataclass(frozen=True)
class MegatronIndex:
    """An ``.idx``: per sequence its token count and byte offset in the ``.bin``, and the
    sequence index where each document starts (``doc_indices`` ends with the count)."""

    dtype: np.dtype
    sizes: np.ndarray  # int32 tokens per sequence
    pointers: np.ndarray  # int64 byte offset of each sequence
    doc_indices: np.ndarray  # int64, len = documents + 1

    def document_starts(self) -> np.ndarray:
        """Token offset of each document's first token (int64, ascending)."""
        first = self.doc_indices[:-1]
        first = first[first < len(self.sizes)]
        return self.sequence_starts()[first]

    def sequence_starts(self) -> np.ndarray:
        """Token offset of each sequence's first token (int64, ascending)."""
        return (self.pointers // self.dtype.itemsize).astype(np.int64)

    @property
    def tokens(self) -> int:
        if not len(self.sizes):
            return 0
        return int(self.pointers[-1] // self.dtype.itemsize + self.sizes[-1])


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 while the ids fit, int32 above."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)


def dtype_code(dtype: np.dtype) -> int:
    return next(code for code, t in MEGATRON_DTYPES.items() if np.dtype(t) == dtype)


def index_bytes(sizes: np.ndarray, dtype: np.dtype, firsts: np.ndarray | None = None) -> bytes:
    """The ``.idx`` of sequences with these token counts; ``firsts``: the sequence each
    document starts with (None: one sequence per document)."""
    count = len(sizes)
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(count, dtype=np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    firsts = np.arange(count, dtype=np.int64) if firsts is None else np.asarray(firsts, np.int64)
    docs = np.append(firsts, count).astype(np.int64)
    header = MEGATRON_IDX_HEADER + struct.pack("<QBQQ", MEGATRON_IDX_VERSION, dtype_code(dtype),
                                               count, len(docs))  # fmt: skip
    return header + sizes.tobytes() + pointers.tobytes() + docs.tobytes()


def read_index(path: Path) -> MegatronIndex:
    """Parse a Megatron ``.idx`` (what ``MMapIndexedDataset`` writes), memory-mapped."""
    head = len(MEGATRON_IDX_HEADER)
    size = path.stat().st_size
    data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    if size < head + 9 or bytes(data[:head]) != MEGATRON_IDX_HEADER:
        raise ValueError(f"{path}: not a Megatron index file")
    code = int(data[head + 8])
    if code not in MEGATRON_DTYPES:
        raise ValueError(f"{path}: unsupported token dtype code {code}")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    counts = bytes(data[head + 9 : head + 25])
    seqs, docs = struct.unpack("<QQ", counts) if len(counts) == 16 else (0, 0)
    offset = head + 25
    need = offset + seqs * 12 + docs * 8
    if size < need:
        raise ValueError(f"{path}: truncated index ({size} bytes, need {need})")
    sizes = np.frombuffer(data, np.int32, seqs, offset)
    pointers = np.frombuffer(data, np.int64, seqs, offset + seqs * 4)
    doc_indices = np.frombuffer(data, np.int64, docs, offset + seqs * 12)
    return MegatronIndex(dtype, sizes, pointers, doc_indices)
