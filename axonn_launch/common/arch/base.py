"""What an architecture answers: the words a transformer block is described in.

The cost model (memory, step time, checkpoint size), the rules and the traffic model ask
an ``Architecture`` these questions instead of branching on its name; the job side builds
the torch module registered under the same name (``train/models/registry.py``). Torch-free, and
below ``common/models.py``: an architecture reads a ``ModelSpec``'s fields but does not
import it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from axonn_launch.common.grid import Grid

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"
BF16, FP32 = 2, 4
NORM = "norm"  # the ``linear`` of the norm statistics

# Element passes (one read or one write of an element) per token shared by the blocks: a
# residual add reads two and writes one (3); a layout copy reads and writes (2).
ADD_PASSES, COPY_PASSES = 3, 2

ModelShape = Any  # a common.models.ModelSpec (that module imports this one)


@dataclass(frozen=True)
class LinearShape:
    """One Linear of a block and the axes its all-reduces use (axonn.md §2.4).

    ``inner`` splits the input features and carries the forward all-reduce of the
    output; ``outer`` splits the output features and carries the backward all-reduce of
    dX. transpose=True swaps x and y. ``out_groups`` > 0: the output features come in
    that many groups that are never split (Llama's KV heads), so with more ``outer``
    ranks than groups each rank holds one whole group, replicated over
    outer / out_groups ranks. ``segments``: runs of rows stored one after another (q, k
    and v of the fused QKV), for the checkpoint's layout (jobcost.py). ``label``: how
    error messages call its weight block.
    """

    name: str
    fan_in: int
    fan_out: int
    inner: str  # axis splitting fan_in
    outer: str  # axis splitting fan_out
    out_groups: int = 0
    segments: int = 1
    label: str = ""

    def out_split(self, grid: Grid) -> int:
        """Distinct shares of the output features along ``outer``."""
        size = grid.size(self.outer)
        return min(size, self.out_groups) if self.out_groups else size

    def replicas(self, grid: Grid) -> int:
        """Ranks along ``outer`` holding the same weight block (1: none replicated)."""
        return grid.size(self.outer) // self.out_split(grid)

    def rows(self, grid: Grid) -> float:
        """Output features of this rank's weight block."""
        return self.fan_out / self.out_split(grid)

    def cols(self, grid: Grid) -> float:
        """Input features of this rank's weight block."""
        return self.fan_in / grid.size(self.inner)

    def block_elements(self, grid: Grid) -> float:
        """Elements of this rank's weight block before the split over z."""
        return self.fan_in * self.fan_out / (grid.size(self.inner) * self.out_split(grid))


@dataclass(frozen=True)
class Collective:
    """One collective of a block's micro-step; ``elements`` is the full (gathered) size."""

    op: str  # all_reduce | all_gather | reduce_scatter
    axis: str  # x | y | z
    elements: float
    itemsize: int  # bytes per element on the wire
    phase: str  # forward | recompute | backward
    linear: str  # a LinearShape's name (qkv | proj | fc1 | fc2; q | kv | gate_up | down) or norm

    @property
    def nbytes(self) -> float:
        return self.elements * self.itemsize


@dataclass(frozen=True)
class SmallParam:
    """``count`` tensors of ``elements`` each (biases, norms, positions) split over one
    axis only and the same on every z rank; ``segments`` runs per shard (the fused QKV
    bias: q, k and v), for the checkpoint's layout."""

    elements: int
    axis: str
    count: int = 1
    segments: int = 1

    @property
    def total(self) -> int:
        return self.count * self.elements

    def local_elements(self, grid: Grid) -> float:
        return self.total / grid.size(self.axis)

    def boxes(self, grid: Grid) -> int:
        """Saved chunks: one per tensor, shard and run."""
        return self.count * self.segments * grid.size(self.axis)


class Architecture(ABC):
    """One model architecture, as the login node's cost model and rules see it."""

    name: str = ""
    learned_positions: bool = False  # a position table beside the token table

    def mlp_width(self, model: ModelShape) -> int:
        """The MLP's hidden units (``ModelSpec.d_ff``)."""
        return model.ffn_hidden or model.ffn_mult * model.d_model

    @abstractmethod
    def block_linears(self, model: ModelShape) -> tuple[LinearShape, ...]:
        """The Linears of one block in forward order, as the training core builds them."""

    @abstractmethod
    def norm_statistics(self, tokens: float, phase: str, x: int) -> tuple[Collective, ...]:
        """The collectives of the block's norms in one pass, over x."""

    @abstractmethod
    def layer_small_params(self, model: ModelShape) -> tuple[SmallParam, ...]:
        """One block's parameters outside its Linears."""

    @abstractmethod
    def model_small_params(self, model: ModelShape) -> tuple[SmallParam, ...]:
        """The parameters outside the blocks and the vocabulary tables."""

    @abstractmethod
    def layer_activation_bytes(
        self, model: ModelShape, grid: Grid, tokens: float, half: int
    ) -> float:
        """Bytes one block saves for its backward (``half``: the autocast dtype's bytes)."""

    @abstractmethod
    def elementwise_passes(self, model: ModelShape, grid: Grid) -> float:
        """Element passes per token of one block's element-wise kernels, forward."""

    @abstractmethod
    def shape_problem(self, model: ModelShape) -> str | None:
        """Why this architecture cannot build ``model`` (one line), or None."""
