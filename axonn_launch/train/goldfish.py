"""The Goldfish loss mask (axonn.md section 7.2; Hans et al., NeurIPS'24).

``keep_mask`` says which labels stay in the loss, as the reference implementation
(goldfish-loss ``lit_gpt/utils.py:apply_goldfish``) computes it on the sequence that
starts at the label's document, whatever window the label falls in. Strategies:
``hash-table``, ``hash-avalanche``, ``static``; ``k = 0`` keeps everything.

Each strategy's exact rule: ``docs/data.md`` ("train/goldfish.py").
"""

from __future__ import annotations

import torch

STRATEGIES = ("hash-table", "hash-avalanche", "static")
TABLE_SIZE = 1_000_003
TABLE_SEED = 2971215073  # fib47, a prime (the reference's comment)
MISSING = -1

_tables: dict[torch.device, torch.Tensor] = {}


def hash_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The reference's random table on ``device``, made once per device."""
    device = torch.device(device)
    if device not in _tables:
        rng = torch.Generator(device=device)
        rng.manual_seed(TABLE_SEED)
        _tables[device] = torch.rand(TABLE_SIZE, device=device, generator=rng)
    return _tables[device]


def keep_mask(
    labels_ext: torch.Tensor,
    positions: torch.Tensor,
    k: int,
    h: int,
    strategy: str,
    *,
    start: int = 0,
) -> torch.Tensor:
    """Bool ``[B, n]``: True where the label stays in the loss.

    ``labels_ext`` is ``[B, n + h - 1]``: the ``h - 1`` labels before the window (``-1``
    where the stream has none), then its ``n`` labels. ``positions`` is ``[B, n]``: each
    label's index from its document's start. ``start`` is the static strategy's offset.
    """
    _check(labels_ext, positions, k, h, strategy, start)
    if k == 0:
        return torch.ones_like(positions, dtype=torch.bool)
    if strategy == "static":
        return ~((positions >= start) & ((positions - start) % k == 0))
    windows = labels_ext.long().unfold(1, h, 1)  # [B, n, h], each ending at its label
    drop = _hash_drop(windows.prod(dim=-1), k, strategy)
    full = (windows != MISSING).all(dim=-1) & (positions >= h - 1)
    return ~(drop & full)


def _hash_drop(products: torch.Tensor, k: int, strategy: str) -> torch.Tensor:
    if strategy == "hash-table":
        return hash_table(products.device)[products % TABLE_SIZE] < 1 / k
    return thomas_wang_32(products) < ((1 << 32) - 1) / k


def _check(
    labels_ext: torch.Tensor, positions: torch.Tensor, k: int, h: int, strategy: str, start: int
) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if k < 0:
        raise ValueError(f"k={k}: expected 0 (off) or a positive integer")
    if h < 1:
        raise ValueError(f"h={h}: expected a context width of at least 1")
    if start < 0:
        raise ValueError(f"start={start}: expected a position >= 0")
    if positions.dim() != 2 or labels_ext.shape != (positions.shape[0], positions.shape[1] + h - 1):
        raise ValueError(
            f"labels_ext shape {tuple(labels_ext.shape)}: expected [B, n + h - 1] ="
            f" {[positions.shape[0], positions.shape[-1] + h - 1]} for positions"
            f" {tuple(positions.shape)} and h={h}"
        )


# ----------------------------------------------------------------- Thomas Wang's hash

_MASK32 = (1 << 32) - 1


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (uint64 ``>>``; torch's int64 ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def thomas_wang_32(keys: torch.Tensor) -> torch.Tensor:
    """The reference's ``hashint(keys.to(uint64), width=32)`` computed on int64 bits.

    Two's complement int64 ``+ - * << ~ & ^`` give the same bits as uint64; only ``>>``
    differs, hence ``_srl``. The result is in ``[0, 2**32)``.
    """
    key = keys.long()
    key = (~key + (key << 21)) & _MASK32
    key = (key << 21) - key - 1
    key = key ^ _srl(key, 24)
    key = ((key + (key << 3)) + (key << 8)) & _MASK32
    key = key * 265
    key = key ^ _srl(key, 14)
    key = ((key + (key << 2)) + (key << 4)) & _MASK32
    key = key * 21
    key = key ^ _srl(key, 28)
    return (key + (key << 31)) & _MASK32
