"""The torch process groups of AxoNN's 4D grid, built from ``axonn_launch.common.grid.Grid``.

Every rank creates every group in the same order (``torch.distributed.new_group`` is a
collective over the whole world). Groups of size one are not created: their field is
``None`` and ``comm`` skips every collective over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from axonn_launch.common.grid import Coords, Grid

GROUP_AXES = ("x", "y", "z", "data", "plane")


@dataclass(frozen=True)
class Groups:
    """This rank's place in the grid and its process group along each axis.

    ``plane`` is the x*y plane (fixed z and data) that holds one vocab-parallel
    embedding / LM head / cross-entropy. Within the plane a rank's index is
    ``x + grid.x * y`` (the group's ranks are in ascending global order).
    ``z_gather`` has the same members as ``z``; the weight all-gathers run on it so that
    prefetched all-gathers do not queue behind reduce-scatters on one communicator.
    ``world`` has every rank: the once-per-step loss average and the sample's token
    broadcast run on it rather than on the default group, because some torch modules
    (``torch._dynamo``, which activation checkpointing imports) keep the default group alive after
    ``destroy_process_group``. A group that outlives it still runs its worker threads
    when the interpreter shuts down, and a gloo worker that releases a tensor then
    aborts the process ("terminate called without an active exception").
    """

    grid: Grid
    rank: int
    coords: Coords
    x: dist.ProcessGroup | None
    y: dist.ProcessGroup | None
    z: dist.ProcessGroup | None
    data: dist.ProcessGroup | None
    plane: dist.ProcessGroup | None
    z_gather: dist.ProcessGroup | None = None
    world: dist.ProcessGroup | None = None

    def size(self, axis: str) -> int:
        if axis == "plane":
            return self.grid.x * self.grid.y
        return self.grid.size(axis)

    def index(self, axis: str) -> int:
        """This rank's position inside its group along ``axis``."""
        if axis == "plane":
            return self.coords.x + self.grid.x * self.coords.y
        return getattr(self.coords, axis)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        if axis == "z_gather":
            return self.z_gather if self.z_gather is not None else self.z
        if axis not in GROUP_AXES:
            raise ValueError(f"unknown axis {axis!r}; valid: {', '.join(GROUP_AXES)}")
        return getattr(self, axis)


def single_process_groups(grid: Grid | None = None) -> Groups:
    """Groups for a one-rank world; needs no initialized process group."""
    grid = grid or Grid()
    if grid.world_size != 1:
        raise ValueError(f"single_process_groups needs a grid of one rank, got {grid.describe()}")
    return Groups(
        grid=grid, rank=0, coords=grid.coords(0), x=None, y=None, z=None, data=None, plane=None
    )


def build_groups(grid: Grid, *, rank: int) -> Groups:
    """Create all groups of ``grid``; must be called by every rank of the world."""
    if dist.is_initialized() and dist.get_world_size() != grid.world_size:
        raise ValueError(
            f"grid {grid.describe()} has {grid.world_size} ranks, "
            f"the process group has {dist.get_world_size()}"
        )
    if grid.world_size == 1:
        return single_process_groups(grid)
    mine = {axis: _create_axis_groups(grid, axis, rank) for axis in GROUP_AXES}
    z_gather = _create_axis_groups(grid, "z", rank)
    world = dist.new_group(list(range(grid.world_size)))
    return Groups(
        grid=grid, rank=rank, coords=grid.coords(rank), z_gather=z_gather, world=world, **mine
    )


def _create_axis_groups(grid: Grid, axis: str, rank: int) -> dist.ProcessGroup | None:
    rank_lists = grid.plane_groups() if axis == "plane" else grid.groups(axis)
    if len(rank_lists[0]) == 1:
        return None
    own = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            own = group
    return own
