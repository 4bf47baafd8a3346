"""Grid-independent initialization that costs each rank only its own shard.

Every element of a full parameter gets its value from a counter-based generator keyed by
(seed, parameter name, the element's flat position), so the weights are the same on
every grid, bit for bit on CPU and GPU, and the cost per rank is O(shard).

The generator: ``docs/job-side.md`` ("train/parallel/init.py").
"""

from __future__ import annotations

import hashlib
import math

import torch

from axonn_launch.train.parallel.groups import Groups
from axonn_launch.train.parallel.shards import Piece, piece_view, shard_pieces

GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
MIX2 = -7723592293110705685  # 0x94D049BB133111EB
UNIFORMS = 8  # 16-bit uniforms summed per value
SCALE = math.sqrt(12 / UNIFORMS) / 65536  # sum of UNIFORMS uniforms on [0, 65536) -> unit variance
CHUNK = 1 << 16  # elements per vectorized batch (int64 temporaries stay in cache)


def parameter_key(seed: int, name: str) -> int:
    """The 63-bit stream key of one parameter."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def init_std(name: str, n_layer: int) -> float | None:
    """GPT-2 init: None for biases (0) and norms (1), else the normal's std."""
    if name.rsplit(".", 1)[-1] == "bias" or ".ln" in name or name.startswith("ln_"):
        return None
    if name.endswith(("attn.proj.weight", "mlp.down.weight")):
        return 0.02 / math.sqrt(2 * n_layer)
    return 0.02


def constant_value(name: str) -> float:
    return 0.0 if name.rsplit(".", 1)[-1] == "bias" else 1.0


def _mix_(z: torch.Tensor, scratch: torch.Tensor) -> None:
    """splitmix64's finalizer in place; right shifts made logical by a mask."""
    for shift, factor in ((30, MIX1), (27, MIX2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=scratch)
        z.bitwise_xor_(scratch.bitwise_and_((1 << (64 - shift)) - 1))
        if factor is not None:
            z.mul_(factor)


def normal_at(key: int, positions: torch.Tensor, std: float) -> torch.Tensor:
    """float32 draws with standard deviation ``std`` at int64 ``positions`` of stream ``key``."""
    total = torch.zeros_like(positions)
    h, scratch = torch.empty_like(positions), torch.empty_like(positions)
    for lane in range(2):
        torch.mul(positions, 2, out=h).add_(lane).mul_(GOLDEN).add_(key)
        _mix_(h, scratch)
        for part in range(4):
            torch.bitwise_right_shift(h, 16 * part, out=scratch)
            total.add_(scratch.bitwise_and_(0xFFFF))
    # 2 * (total - mean) is an exact integer; the float multiply halves it
    centred = total.mul_(2).sub_(UNIFORMS * 65535).to(torch.float32)
    return centred.mul_(SCALE * std / 2)


def _fill_piece(view: torch.Tensor, piece: Piece, full_shape, key: int, std: float) -> None:
    """Draws for the box ``piece`` of a full tensor of ``full_shape`` into ``view``."""
    cols = math.prod(full_shape[1:])
    row_numel = math.prod(piece.sizes[1:])
    col0 = piece.offsets[1] if len(piece.offsets) > 1 else 0
    step = max(1, CHUNK // row_numel)
    within = torch.arange(row_numel, dtype=torch.int64, device=view.device) + col0
    flat = view.reshape(piece.sizes[0], row_numel)
    for r in range(0, piece.sizes[0], step):
        k = min(step, piece.sizes[0] - r)
        rows = torch.arange(k, dtype=torch.int64, device=view.device) + piece.offsets[0] + r
        positions = rows[:, None] * cols + within[None, :]
        flat[r : r + k] = normal_at(key, positions, std).to(view.dtype)


@torch.no_grad()
def init_shard(param: torch.Tensor, name: str, groups: Groups, seed: int, n_layer: int) -> None:
    """Initialize this rank's shard of parameter ``name`` (padding stays 0)."""
    layout = param.shard_layout
    std = init_std(name, n_layer)
    param.zero_()
    key = parameter_key(seed, name)
    for piece in shard_pieces(layout, groups):
        view = piece_view(param, piece)
        if std is None:
            view.fill_(constant_value(name))
        else:
            _fill_piece(view, piece, layout.full_shape, key, std)
