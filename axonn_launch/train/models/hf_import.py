"""Start a Llama from Hugging Face safetensors, each rank reading only its shard.

``load_hf_weights(model, groups, hf_dir)`` fills every parameter of this rank with the
rows and columns of the HF tensors its shard holds (``common/hf.hf_segments``), read with
safetensors' ``get_slice``; a tensor stored as integers, or holding a NaN or an infinity,
is refused in one line naming it.

How the reads are cut: ``docs/checkpoints.md`` ("train/models/hf_import.py").
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from axonn_launch.common.hf import FLOAT_DTYPES, INDEX, SINGLE, HFConfigError, hf_segments
from axonn_launch.train.parallel.groups import Groups
from axonn_launch.train.parallel.shards import Piece, piece_view, shard_pieces


@dataclass
class ImportStats:
    """What this rank read: bytes of tensor data, in all and per HF tensor touched."""

    bytes_read: int = 0
    bytes_by_tensor: dict[str, int] = field(default_factory=dict)

    @property
    def tensors(self) -> set[str]:
        return set(self.bytes_by_tensor)

    @property
    def tensors_touched(self) -> int:
        return len(self.bytes_by_tensor)

    def add(self, name: str, nbytes: int) -> None:
        self.bytes_read += nbytes
        self.bytes_by_tensor[name] = self.bytes_by_tensor.get(name, 0) + nbytes


def weight_map(hf_dir: str | Path) -> dict[str, str]:
    """HF tensor name -> safetensors file (relative to ``hf_dir``)."""
    path = Path(hf_dir)
    if (path / INDEX).is_file():
        return dict(json.loads((path / INDEX).read_text())["weight_map"])
    if (path / SINGLE).is_file():
        with safe_open(str(path / SINGLE), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), SINGLE)
    raise HFConfigError(f"{hf_dir}: has no safetensors weights ({SINGLE} or {INDEX})")


class _Files:
    """Open safetensors files, each opened once, by tensor name."""

    def __init__(self, hf_dir: Path, stack: ExitStack) -> None:
        self.dir, self.stack = hf_dir, stack
        self.map = weight_map(hf_dir)
        self.open: dict[str, object] = {}

    def slice(self, name: str):
        if name not in self.map:
            raise HFConfigError(f"{self.dir}: the weights have no tensor {name!r}")
        file = self.map[name]
        if file not in self.open:
            handle = safe_open(str(self.dir / file), framework="pt")
            self.open[file] = self.stack.enter_context(handle)
        return self.open[file].get_slice(name)


def _copy_piece(
    files: _Files,
    local: torch.Tensor,
    piece: Piece,
    segments: list[tuple[str, int]],
    columns: int | None,
    stats: ImportStats,
) -> None:
    """Fill ``piece`` of ``local`` from the HF tensors (rows stacked) it overlaps."""
    view = piece_view(local, piece)
    lo, hi = piece.offsets[0], piece.offsets[0] + piece.sizes[0]
    start = 0
    for hf_name, rows in segments:
        a, b = max(lo, start), min(hi, start + rows)
        if a < b:
            sl = files.slice(hf_name)
            if sl.get_dtype() not in FLOAT_DTYPES:
                raise HFConfigError(
                    f"{files.dir}: tensor {hf_name} is stored as {sl.get_dtype()}; valid: a"
                    f" floating-point dtype ({', '.join(FLOAT_DTYPES)})"
                )
            shape = tuple(sl.get_shape())
            want = (rows,) if columns is None else (rows, columns)
            if shape != want:
                raise HFConfigError(
                    f"{files.dir}: tensor {hf_name} has shape {list(shape)}, expected {list(want)}"
                )
            origin = (a - start,) if columns is None else (a - start, piece.offsets[1])
            if columns is None:
                data = sl[a - start : b - start]
            else:
                c0, c1 = piece.offsets[1], piece.offsets[1] + piece.sizes[1]
                data = sl[a - start : b - start, c0:c1]
            if not torch.isfinite(data).all():
                found = f"{_non_finite(data, origin)}; valid: finite values"
                raise HFConfigError(f"{files.dir}: tensor {hf_name} holds {found}")
            stats.add(hf_name, data.numel() * data.element_size())
            view[a - lo : b - lo].copy_(data.to(view.dtype))
        start += rows


def _non_finite(data: torch.Tensor, origin: tuple[int, ...]) -> str:
    """``2 NaN and 0 inf values, the first at [7, 3]``: counted in ``data``, the part of the
    tensor that starts at ``origin`` (this rank reads only its part)."""
    nan, inf = int(torch.isnan(data).sum()), int(torch.isinf(data).sum())
    first = [
        int(i) + o for i, o in zip(torch.nonzero(~torch.isfinite(data))[0], origin, strict=True)
    ]
    return f"{nan} NaN and {inf} inf values, the first at {first}"


@torch.no_grad()
def load_hf_weights(model: nn.Module, groups: Groups, hf_dir: str | Path) -> ImportStats:
    """Fill this rank's parameters of ``model`` (a Llama) from the HF directory."""
    spec = model.spec
    segments = hf_segments(spec)
    names = {name for name, _ in model.named_parameters()}
    if names != set(segments):
        missing, extra = sorted(set(segments) - names), sorted(names - set(segments))
        raise KeyError(f"model parameters differ from the HF map: missing {missing}, extra {extra}")
    runtime = getattr(model, "runtime", None)
    if runtime is not None:
        runtime.drop_prefetched()
    stats = ImportStats()
    with ExitStack() as stack:
        files = _Files(Path(hf_dir), stack)
        for name, param in model.named_parameters():
            layout = param.shard_layout
            columns = layout.full_shape[1] if len(layout.full_shape) > 1 else None
            local = param.data
            local.zero_()  # padded vocab rows, as local_from_full pads them
            for piece in shard_pieces(layout, groups):
                _copy_piece(files, local, piece, segments[name], columns, stats)
    return stats
