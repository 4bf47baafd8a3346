"""Our flat shards as boxes of the full tensors, for torch.distributed.checkpoint (DCP).

A parameter's shard on a rank is a flat range of a block of the full tensor
(``ShardLayout``); here it becomes a list of ``Piece``s, boxes of the full tensor.
``ShardSavePlanner`` writes one DCP chunk per piece (one replica writes) and
``ShardLoadPlanner`` reads only what a rank's new shard needs, whatever grid wrote it.

How a range becomes boxes, and the row bands: ``docs/checkpoints.md``
("train/parallel/shards.py").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from axonn_launch.common.grid import Grid
from axonn_launch.train.parallel.groups import Groups
from axonn_launch.train.parallel.layers import ShardLayout

BAND_BYTES = 32 << 20  # largest chunk written; bounds what one read deserializes


@dataclass(frozen=True)
class Piece:
    """``local[start : start + prod(sizes)]`` is the full tensor's box at ``offsets``."""

    start: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's flat shard of a tensor sits in the full tensor."""

    full_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    writes: bool  # False on all but one of the ranks holding identical copies


def grid_position(grid: Grid, rank: int) -> Groups:
    """Coordinates of ``rank`` in ``grid`` as a ``Groups`` without process groups."""
    none = dict.fromkeys(("x", "y", "z", "data", "plane"))
    return Groups(grid=grid, rank=rank, coords=grid.coords(rank), **none)


def _chunk(start: int, length: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk`` of [start, start+length) into ``parts``: the ``index``-th range."""
    size = -(-length // parts)
    lo = min(length, index * size)
    return start + lo, min(size, length - lo)


def block_range(layout: ShardLayout, groups: Groups) -> tuple[list[tuple[int, int]], int, int]:
    """Per-dim (start, length) of the rank's block and its flat range [s, e) in the block."""
    rows = layout.pad_rows_to or layout.full_shape[0]
    ranges = [(0, rows), *((0, n) for n in layout.full_shape[1:])]
    for dim, axis in layout.splits:
        ranges[dim] = _chunk(*ranges[dim], *layout.split(axis, groups))
    numel = math.prod(n for _, n in ranges)
    if layout.flatten_over_z:
        s, n = _chunk(0, numel, groups.size("z"), groups.index("z"))
        return ranges, s, s + n
    return ranges, 0, numel


def _row_runs(s: int, e: int, cols: int) -> list[tuple[int, int, int, int]]:
    """[s, e) of a row-major block with ``cols`` columns as (row, rows, col, cols) boxes."""
    runs, pos = [], s
    while pos < e:
        row, col = divmod(pos, cols)
        if col == 0 and e - pos >= cols:
            k = (e - pos) // cols
            runs.append((row, k, 0, cols))
            pos += k * cols
        else:
            n = min(cols - col, e - pos)
            runs.append((row, 1, col, n))
            pos += n
    return runs


def _full_rows(layout: ShardLayout, first: int, count: int) -> list[tuple[int, int, int]]:
    """Padded/permuted rows [first, first+count) as (offset, full row, rows) runs of
    consecutive full rows; padding rows are left out."""
    end = min(first + count, layout.full_shape[0])
    if end <= first:
        return []
    if layout.row_order is None:
        return [(0, first, end - first)]
    rows = layout.row_order[first:end].tolist()
    runs, begin = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append((begin, rows[begin], i - begin))
            begin = i
    return runs


def shard_pieces(layout: ShardLayout, groups: Groups) -> list[Piece]:
    """This rank's shard of ``layout`` as boxes of the full tensor (see module docstring)."""
    if len(layout.full_shape) > 2:
        raise ValueError(f"shard_pieces handles 1-D and 2-D tensors, got {layout.full_shape}")
    ranges, s, e = block_range(layout, groups)
    (row0, _), *rest = ranges
    col0, cols = rest[0] if rest else (0, 1)
    pieces = []
    for row, k, col, n in _row_runs(s, e, cols):
        base = row * cols + col - s
        for skip, full_row, rows in _full_rows(layout, row0 + row, k):
            if rest:
                offsets, sizes = (full_row, col0 + col), (rows, n)
            else:
                offsets, sizes = (full_row,), (rows,)
            pieces.append(Piece(base + skip * cols, offsets, sizes))
    return pieces


def band_split(piece: Piece, element_bytes: int, band_bytes: int = BAND_BYTES) -> list[Piece]:
    """``piece`` cut into row bands of at most ``band_bytes`` (at least one row each)."""
    row_numel = math.prod(piece.sizes[1:])
    rows = max(1, band_bytes // max(1, row_numel * element_bytes))
    if piece.sizes[0] <= rows:
        return [piece]
    bands = []
    for r in range(0, piece.sizes[0], rows):
        k = min(rows, piece.sizes[0] - r)
        offsets = (piece.offsets[0] + r, *piece.offsets[1:])
        bands.append(Piece(piece.start + r * row_numel, offsets, (k, *piece.sizes[1:])))
    return bands


def shard_spec(
    layout: ShardLayout, groups: Groups, element_bytes: int = 4, *, banded: bool = True
) -> ShardSpec:
    """The pieces of this rank and whether it is the one replica that writes.

    Saving cuts the pieces into bands (``banded``); loading must not: each saved chunk a
    local piece overlaps is deserialized whole once per local piece that overlaps it.
    """
    pieces = shard_pieces(layout, groups)
    if banded:
        pieces = [b for p in pieces for b in band_split(p, element_bytes)]
    writes = layout.owns_copy(groups) and groups.coords.data == 0
    return ShardSpec(tuple(layout.full_shape), tuple(pieces), writes)


def piece_view(local: torch.Tensor, piece: Piece) -> torch.Tensor:
    return local.reshape(-1)[piece.start : piece.start + piece.numel].view(piece.sizes)


class ShardSavePlanner(DefaultSavePlanner):
    """Writes each sharded key as its pieces; every other key as DCP does by default, but
    that a key of ``replicated`` (the same on every rank: AdamW's step counts, the meta
    string) is planned by the coordinator alone.

    DCP plans a plain key on every rank and keeps one copy when the coordinator merges the
    plans: ranks x keys items that it gathers and deduplicates (at 32,768 ranks and
    gpt_320b's step counts: ``bench/scale/dcp_plan.py``). The saved checkpoint holds the
    same keys either way."""

    def __init__(self, specs: dict[str, ShardSpec], replicated: Collection[str] = ()) -> None:
        super().__init__()
        self.specs = specs
        self.replicated = frozenset(replicated)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.views = {
            (fqn, piece.offsets): piece_view(self.state_dict[fqn], piece)
            for fqn, spec in self.specs.items()
            for piece in spec.pieces
        }

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan, with the ranks' key mappings merged in one pass. DCP merges
        them with a ``ChainMap``, whose lookup of a key walks the ranks' maps in order:
        each rank's own ``rank_state.<r>`` is found after r maps, so the merge costs
        ranks^2 / 2 lookups in all (``bench/scale/dcp_plan.py``)."""
        merged: dict = {}
        for plan in reversed(all_plans):  # the first rank's mapping of a key wins, as in DCP
            merged.update(plan.planner_data or {})
        bare = [dataclasses.replace(plan, planner_data={}) for plan in all_plans]
        global_plan, metadata = super().create_global_plan(bare)
        self.metadata = dataclasses.replace(metadata, planner_data=merged)
        return global_plan, self.metadata

    def create_local_plan(self) -> SavePlan:
        plain = {
            k: v
            for k, v in self.state_dict.items()
            if k not in self.specs and (self.is_coordinator or k not in self.replicated)
        }
        items = list(create_default_local_save_plan(plain, self.is_coordinator).items)
        for fqn, spec in self.specs.items():
            if not spec.writes:
                continue
            dtype = self.state_dict[fqn].dtype
            for piece in spec.pieces:
                items.append(_write_item(fqn, piece, spec.full_shape, dtype))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        key = (write_item.index.fqn, tuple(write_item.index.offset or ()))
        if write_item.index.fqn in self.specs:
            return self.views[key]
        return super().resolve_data(write_item)


def _write_item(fqn: str, piece: Piece, shape: tuple[int, ...], dtype: torch.dtype) -> WriteItem:
    offsets, sizes = torch.Size(piece.offsets), torch.Size(piece.sizes)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
        ),
    )


class ShardLoadPlanner(DefaultLoadPlanner):
    """Reads into each sharded key the overlap of its pieces with the saved chunks."""

    def __init__(self, specs: dict[str, ShardSpec]) -> None:
        super().__init__()
        self.specs = specs

    def create_local_plan(self) -> LoadPlan:
        plain = {k: v for k, v in self.state_dict.items() if k not in self.specs}
        items = list(create_default_local_load_plan(plain, self.metadata, strict=True).items)
        for fqn, spec in self.specs.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise KeyError(f"checkpoint has no tensor {fqn!r}")
            if tuple(md.size) != spec.full_shape:
                raise ValueError(
                    f"{fqn}: checkpoint shape {tuple(md.size)}, model {spec.full_shape}"
                )
            chunks = [
                ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes))
                for p in spec.pieces
            ]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        if fqn not in self.specs:
            return super().resolve_tensor(read_item)
        piece = self.specs[fqn].pieces[read_item.dest_index.index]
        view = piece_view(self.state_dict[fqn], piece)
        for dim, (offset, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            view = view.narrow(dim, offset, length)
        return view


class CountingReader(FileSystemReader):
    """A ``FileSystemReader`` that counts the bytes of the saved items it reads."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.bytes_read = 0

    def _slice_file(self, file, sinfo):
        self.bytes_read += sinfo.length
        return super()._slice_file(file, sinfo)
