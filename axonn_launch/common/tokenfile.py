"""A token ``.bin`` checked on the login node: cheaply, and without numpy or torch.

``problem`` applies the job's rules for ``train.data=PATH.bin`` (its dtype, its length,
its ids below the vocabulary) before any rank starts, judging the ids by the sidecar's
``max_token_id`` or a sample. The job still checks every window it reads.

Where the dtype comes from and what is checked: ``docs/data.md`` ("common/tokenfile.py").
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MEGATRON_IDX_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPE_NAMES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
FORMATS = {"uint8": "B", "int8": "b", "uint16": "H", "int16": "h", "uint32": "I", "int32": "i",
           "uint64": "Q", "int64": "q"}  # fmt: skip
SAMPLE_BYTES = 4 << 20
SAMPLE_PIECES = 16
VALID = "valid: shakespeare, synthetic, or a path to a .bin token file"


class TokenFileError(ValueError):
    """What is wrong with a token file, as the tail of a one-line error."""


@dataclass(frozen=True)
class Layout:
    """How the job will read a token file: its dtype, length and id bound, with where
    each came from (for the messages)."""

    path: Path
    dtype: str
    dtype_from: str
    tokens_in_index: int | None  # what the .idx indexes; None without one (or no sequences)
    vocab: int  # ids must be below this
    vocab_from: str
    max_id: int | None  # the sidecar's max_token_id

    @property
    def itemsize(self) -> int:
        return struct.calcsize(FORMATS[self.dtype])


def problem(key: str, value: str, model_vocab: int) -> str | None:
    """One line naming ``key``, its ``value`` and what would be valid; None when a cheap
    look finds nothing wrong. ``value`` names a path that exists."""
    path = Path(value)
    if not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file"
        return f"{key}={value!r}: {what}; {VALID}"
    try:
        layout = read_layout(path, model_vocab)
        check_size(layout, path.stat().st_size)
        check_ids(layout, model_vocab)
    except TokenFileError as error:
        return f"{key}={value!r}: {error}"
    return None


def read_layout(path: Path, model_vocab: int) -> Layout:
    """The job's dtype and id bound for ``path``: the one owner of the ``.bin`` rules (the
    job's ``train.data.bin_dtype`` and the memorization metric read through here)."""
    sidecar = path.with_name(path.name + ".json")
    meta = read_sidecar(sidecar) if sidecar.exists() else {}
    vocab, vocab_from = model_vocab, f"model.vocab_size={model_vocab}"
    if "vocab_size" in meta:
        vocab, vocab_from = meta["vocab_size"], f"vocab_size {meta['vocab_size']} in {sidecar.name}"
    dtype, dtype_from, tokens = _dtype_of(path, meta, model_vocab)
    return Layout(path, dtype, dtype_from, tokens, vocab, vocab_from, meta.get("max_token_id"))


def bin_dtype(path: Path, model_vocab: int | None) -> str:
    """The dtype of a token ``.bin``: its ``.idx``'s, else its sidecar's, else the one for
    ``model_vocab`` (None: unknown, a TokenFileError when nothing else says)."""
    sidecar = path.with_name(path.name + ".json")
    return _dtype_of(path, read_sidecar(sidecar) if sidecar.exists() else {}, model_vocab)[0]


def dtype_for_vocab(vocab: int) -> str:
    """A ``.bin``'s dtype when nothing beside it names one: uint16 while the ids fit."""
    return "uint16" if vocab <= 2**16 else "uint32"


def _dtype_of(path: Path, meta: dict, model_vocab: int | None) -> tuple[str, str, int | None]:
    """(dtype, where it came from, tokens the ``.idx`` indexes) of ``path``."""
    idx = path.with_suffix(".idx")
    if idx.exists():
        dtype, tokens = read_index_header(idx)
        return dtype, f"the dtype of {idx.name}", tokens
    if "dtype" in meta:
        return meta["dtype"], f"the dtype in {path.name}.json", None
    if model_vocab is None:
        raise TokenFileError(
            f"{path.name}: no .idx or .bin.json beside it names its dtype, and no model vocab"
            ' size to choose one; valid: a .bin.json naming it, e.g. {"dtype": "uint32"}'
        )
    why = f"the dtype for model.vocab_size={model_vocab}, with no .idx or .bin.json beside it"
    return dtype_for_vocab(model_vocab), why, None


def read_sidecar(path: Path) -> dict:
    """The ``.bin.json`` sidecar, its ``dtype``, ``vocab_size`` and ``max_token_id`` checked."""
    example = 'e.g. {"dtype": "uint16", "vocab_size": 50257}'
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenFileError(f"{path.name} is not JSON ({error}); valid: {example}") from None
    if not isinstance(meta, dict):
        raise TokenFileError(f"{path.name} is not a JSON object; valid: {example}")
    if "dtype" in meta and meta["dtype"] not in FORMATS:
        raise TokenFileError(
            f"{path.name} gives dtype {meta['dtype']!r}; valid: {', '.join(FORMATS)}"
        )
    for name, least in (("vocab_size", 1), ("max_token_id", 0)):
        if name in meta and not (isinstance(meta[name], int) and meta[name] >= least):
            raise TokenFileError(
                f"{path.name} gives {name} {meta[name]!r}; valid: an integer >= {least}"
            )
    return meta


def read_index_header(path: Path) -> tuple[str, int | None]:
    """(dtype, tokens indexed; None: no sequences) of a Megatron ``.idx``, read from its
    header and its last size and pointer (``data.read_index`` reads it whole)."""
    head, size = len(MEGATRON_IDX_HEADER), path.stat().st_size
    valid = "valid: the .idx that python -m axonn_launch.data writes with the .bin"
    with path.open("rb") as f:
        header = f.read(head + 25).ljust(head + 25, b"\0")
        if size < head + 9 or header[:head] != MEGATRON_IDX_HEADER:
            raise TokenFileError(f"{path.name} is not a Megatron index file; {valid}")
        if header[head + 8] not in MEGATRON_DTYPE_NAMES:
            raise TokenFileError(f"{path.name} gives dtype code {header[head + 8]}; {valid}")
        dtype = MEGATRON_DTYPE_NAMES[header[head + 8]]
        seqs, docs = struct.unpack("<QQ", header[head + 9 :])
        if size < head + 25 + seqs * 12 + docs * 8:
            raise TokenFileError(f"{path.name} is truncated ({size} bytes); {valid}")
        if not seqs:
            return dtype, None
        f.seek(head + 25 + (seqs - 1) * 4)
        (last_size,) = struct.unpack("<i", f.read(4))
        f.seek(head + 25 + seqs * 4 + (seqs - 1) * 8)
        (last_pointer,) = struct.unpack("<q", f.read(8))
    return dtype, last_pointer // struct.calcsize(FORMATS[dtype]) + last_size


def check_size(layout: Layout, size: int) -> None:
    """An empty file, a partial token, or another length than its index says."""
    dtype, itemsize = layout.dtype, layout.itemsize
    if size == 0:
        raise TokenFileError(
            f"an empty file; valid: a .bin of {dtype} token ids ({layout.dtype_from})"
        )
    if size % itemsize:
        raise TokenFileError(
            f"{size:,} bytes is not a whole number of {dtype} tokens ({itemsize} bytes each,"
            f" {layout.dtype_from}); valid: a file of {dtype} ids, or a .bin.json beside it"
            ' naming the dtype it holds, e.g. {"dtype": "uint8"}'
        )
    indexed = layout.tokens_in_index
    if indexed is not None and indexed != size // itemsize:
        raise TokenFileError(
            f"{layout.path.with_suffix('.idx').name} indexes {indexed:,} tokens but the file"
            f" holds {size // itemsize:,} {dtype} tokens; valid: the .bin and .idx written together"
        )


def check_ids(layout: Layout, model_vocab: int) -> None:
    """The vocabulary against the model's, then the ids against the vocabulary."""
    if layout.vocab > model_vocab:
        raise TokenFileError(
            f"{layout.vocab_from}, more than model.vocab_size={model_vocab}; valid: a model"
            f" with model.vocab_size >= {layout.vocab}, or tokens of at most {model_vocab} ids"
        )
    if layout.max_id is not None:
        if layout.max_id >= layout.vocab:
            raise TokenFileError(
                f"its largest token id is {layout.max_id:,} (max_token_id in"
                f" {layout.path.name}.json), outside [0, {layout.vocab}) ({layout.vocab_from});"
                f" valid: ids below {layout.vocab}"
            )
        return
    for first, ids in sample(layout):
        if max(ids) >= layout.vocab or min(ids) < 0:
            at, value = next((i, v) for i, v in enumerate(ids) if not 0 <= v < layout.vocab)
            raise TokenFileError(
                f"token id {value:,} at token {first + at:,} is outside [0, {layout.vocab})"
                f" ({layout.vocab_from}; read as {layout.dtype}, {layout.dtype_from});"
                f" valid: ids below {layout.vocab}"
            )


def sample(layout: Layout) -> Iterator[tuple[int, memoryview]]:
    """(first token, ids) of the whole file up to ``SAMPLE_BYTES``, else of
    ``SAMPLE_PIECES`` pieces from its start to its end."""
    itemsize, code = layout.itemsize, FORMATS[layout.dtype]
    tokens = layout.path.stat().st_size // itemsize
    per_piece = SAMPLE_BYTES // SAMPLE_PIECES // itemsize
    if tokens * itemsize <= SAMPLE_BYTES:
        starts, per_piece = [0], tokens
    else:
        gap = (tokens - per_piece) / (SAMPLE_PIECES - 1)
        starts = [round(i * gap) for i in range(SAMPLE_PIECES)]
    with layout.path.open("rb") as f:
        for first in starts:
            f.seek(first * itemsize)
            yield first, memoryview(f.read(per_piece * itemsize)).cast(code)
