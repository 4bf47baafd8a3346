"""Megatron's indexed token format (``MMapIndexedDataset``): ``PREFIX.bin`` holds the tokens,
``PREFIX.idx`` the sequence sizes, their byte offsets and the first sequence of each document.
``IndexedWriter`` writes it (the data and study commands), ``read_index`` reads it (the job,
the login node's checks); numpy only, no torch.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
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


class IndexedWriter:
    """Writes PREFIX.bin (+ .mask), then .idx and .bin.json; all under temporary names
    until ``commit``; ``abort`` (or an exception in a ``with`` block) removes them."""

    def __init__(self, prefix: Path, dtype: np.dtype, *, masked: bool = False) -> None:
        self.prefix = prefix
        self.dtype = dtype
        self.sizes: list[np.ndarray] = []
        self.firsts: list[int] = []  # the sequence each document starts with
        self.sequences = 0
        self.max_id = -1  # the largest token id written (the sidecar's max_token_id)
        self.names = [".bin", ".idx", ".bin.json"] + ([MASK_SUFFIX] if masked else [])
        self.tmp = {s: prefix.with_name(f".{prefix.name}{s}.tmp{os.getpid()}") for s in self.names}
        self.bin = self.tmp[".bin"].open("wb")
        self.mask = self.tmp[MASK_SUFFIX].open("wb") if masked else None

    def add(
        self,
        tokens: np.ndarray,
        sizes: Sequence[int],
        mask: np.ndarray | None = None,
        *,
        one_document: bool = False,
    ) -> None:
        """Sequences of ``sizes`` tokens, concatenated in ``tokens``: each a document, or
        with ``one_document`` together one."""
        ids = np.asarray(tokens, dtype=self.dtype)
        self.bin.write(ids.tobytes())
        if ids.size:
            self.max_id = max(self.max_id, int(ids.max()))
        if self.mask is not None:
            self.mask.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self.sizes.append(np.asarray(sizes, dtype=np.int64))
        starts = range(self.sequences, self.sequences + (1 if one_document else len(sizes)))
        self.firsts.extend(starts)
        self.sequences += len(sizes)

    def commit(self, meta: dict) -> dict:
        """Write the index and sidecar, rename everything into place; the sidecar's dict."""
        self._close()
        sizes = np.concatenate(self.sizes) if self.sizes else np.zeros(0, dtype=np.int64)
        self.tmp[".idx"].write_bytes(index_bytes(sizes, self.dtype, np.array(self.firsts)))
        meta = {"dtype": self.dtype.name, **meta, "documents": len(self.firsts),
                "tokens": int(sizes.sum())}  # fmt: skip
        if self.max_id >= 0:  # the launcher checks it against the model's vocabulary
            meta["max_token_id"] = self.max_id
        self.tmp[".bin.json"].write_text(json.dumps(meta, indent=1) + "\n")
        for suffix in sorted(self.names, key=lambda s: s == ".bin"):  # the .bin last
            self.tmp[suffix].replace(self.prefix.with_name(self.prefix.name + suffix))
        return meta

    def abort(self) -> None:
        self._close()
        for path in self.tmp.values():
            path.unlink(missing_ok=True)

    def _close(self) -> None:
        for handle in (self.bin, self.mask):
            if handle is not None:
                handle.close()

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:
            self.abort()


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


CHECK_CHUNK = 1 << 22  # entries checked at a time: bounded memory for any index
VALID_INDEX = "valid: the .idx that python -m axonn_launch.data writes with the .bin"


def index_problem(index: MegatronIndex, bin_bytes: int) -> str | None:
    """What makes ``index`` unusable with a ``.bin`` of ``bin_bytes`` bytes (one clause,
    naming the first bad entry), or None. Every entry, vectorized in chunks: sizes >= 0;
    each pointer a whole token, the sequences in order without overlap, all inside the
    ``.bin``; document indices ascending within the sequence count."""
    itemsize, end_before = index.dtype.itemsize, 0
    for first in range(0, len(index.sizes), CHECK_CHUNK):
        sizes = index.sizes[first : first + CHECK_CHUNK].astype(np.int64)
        pointers = index.pointers[first : first + CHECK_CHUNK]
        problem = _chunk_problem(sizes, pointers, first, end_before, itemsize, bin_bytes)
        if problem:
            return problem
        end_before = int(pointers[-1] + sizes[-1] * itemsize)
    docs, seqs = index.doc_indices, len(index.sizes)
    bad = np.flatnonzero((docs < 0) | (docs > seqs))
    if bad.size:
        return f"document {bad[0]:,} starts at sequence {docs[bad[0]]:,}, outside 0..{seqs:,}"
    bad = np.flatnonzero(np.diff(docs) < 0)
    if bad.size:
        at = bad[0] + 1
        return f"document {at:,} starts at sequence {docs[at]:,}, before document {at - 1:,}"
    return None


def _chunk_problem(
    sizes: np.ndarray,
    pointers: np.ndarray,
    first: int,
    end_before: int,
    itemsize: int,
    bin_bytes: int,
) -> str | None:
    """``index_problem`` for the entries from ``first`` on; ``end_before``: where the
    entry before them ends (bytes)."""
    bad = np.flatnonzero(sizes < 0)
    if bad.size:
        return f"sequence {first + bad[0]:,} has size {sizes[bad[0]]:,}; sizes must be >= 0"
    bad = np.flatnonzero((pointers < 0) | (pointers > bin_bytes) | (pointers % itemsize != 0))
    if bad.size:
        return (
            f"sequence {first + bad[0]:,} starts at byte {pointers[bad[0]]:,}, not a token"
            f" boundary inside the .bin ({bin_bytes:,} bytes)"
        )
    ends = pointers + sizes * itemsize  # no overflow: pointers <= bin_bytes
    bad = np.flatnonzero(ends > bin_bytes)
    if bad.size:
        return (
            f"sequence {first + bad[0]:,} ends at byte {ends[bad[0]]:,}, past the end of the"
            f" .bin ({bin_bytes:,} bytes)"
        )
    previous = np.concatenate(([end_before], ends[:-1]))
    bad = np.flatnonzero(pointers < previous)
    if bad.size:
        at = first + bad[0]
        return (
            f"sequence {at:,} starts at byte {pointers[bad[0]]:,}, before sequence {at - 1:,}"
            f" ends (byte {previous[bad[0]]:,}); sequences must be in order"
        )
    return None


def index_file_problem(key: str, bin_path: str) -> str | None:
    """One line about the ``.idx`` beside ``bin_path`` (``index_problem``), or None (no
    ``.idx``, or a sound one). The login node reads every entry, which is cheap there;
    the job trusts it."""
    path = Path(bin_path)
    idx = path.with_suffix(".idx")
    if not idx.is_file():
        return None
    try:
        problem = index_problem(read_index(idx), path.stat().st_size)
    except (OSError, ValueError) as error:
        problem = str(error)
    return f"{key}={bin_path!r}: {idx.name}: {problem}; {VALID_INDEX}" if problem else None
