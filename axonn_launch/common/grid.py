"""AxoNN's 4D process grid (data x z x y x x), pure Python.

Rank layout follows AxoNN's ``communication.py``: x (AxoNN's "column", the inner
tensor-parallel axis) varies fastest so an x-group stays inside a node, then y
("row"), then z ("depth"), then data. The launcher uses this class on the login
node and the training core uses the same class inside the job, so it must never
import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("x", "y", "z", "data")  # fastest-varying first


@dataclass(frozen=True)
class Coords:
    x: int
    y: int
    z: int
    data: int


@dataclass(frozen=True)
class Grid:
    data: int = 1
    x: int = 1
    y: int = 1
    z: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"grid.{axis}={value!r}: must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.data * self.x * self.y * self.z

    @property
    def tensor_parallel(self) -> int:
        """Ranks that share one model replica (x * y * z)."""
        return self.x * self.y * self.z

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def stride(self, axis: str) -> int:
        """Distance in rank numbers between neighbours along ``axis``."""
        stride = 1
        for name in AXES:
            if name == axis:
                return stride
            stride *= getattr(self, name)
        raise ValueError(f"unknown axis {axis!r}; valid: {', '.join(AXES)}")

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return Coords(
            x=rank % self.x,
            y=(rank // self.x) % self.y,
            z=(rank // (self.x * self.y)) % self.z,
            data=rank // (self.x * self.y * self.z),
        )

    def rank(self, coords: Coords) -> int:
        return sum(getattr(coords, a) * self.stride(a) for a in AXES)

    def groups(self, axis: str) -> list[list[int]]:
        """All rank lists of the groups along ``axis``, in a fixed order.

        Every rank must create every group in this same order.
        """
        return self._groups_over((axis,))

    def plane_groups(self) -> list[list[int]]:
        """The x*y planes (fixed z and data): vocab-parallel embedding and loss."""
        return self._groups_over(("x", "y"))

    def _groups_over(self, axes: tuple[str, ...]) -> list[list[int]]:
        seen: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(getattr(c, a) for a in AXES if a not in axes)
            seen.setdefault(key, []).append(r)
        return list(seen.values())

    def describe(self) -> str:
        return f"data={self.data} x={self.x} y={self.y} z={self.z}"

    def as_dict(self) -> dict[str, int]:
        return {"data": self.data, "x": self.x, "y": self.y, "z": self.z}
