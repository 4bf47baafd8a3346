"""What the attention layers of every architecture share: rotary positions, the KV cache
of generation and the causal (or padded, cached) attention itself.

A ``Positions`` describes one forward: training runs ``[b, s]`` tokens from position 0
with a plain causal mask, or, when rows pack several fine-tuning examples, a causal mask
within each example and positions counted from its first token; generation runs a prompt
batch that is left-padded to one length (``pads[b]`` leading pad tokens per row), then
one token at a time against the keys and values in a ``KVCache``. The cache holds this
rank's heads only (split over y as the activations are), so it is sharded like the
activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from axonn_launch.common.models import ModelSpec


@dataclass
class KVCache:
    """Keys and values of this rank's heads per layer, ``[b, heads, max_len, head_dim]``."""

    max_len: int
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    def extend(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` (``[b, heads, s, d]``) at ``start``; all keys and values so far."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions cannot hold {end}")
        if layer not in self.keys:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys[layer] = k.new_zeros(shape)
            self.values[layer] = v.new_zeros(shape)
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


@dataclass
class Positions:
    """Where the tokens of one forward sit: ``start`` and per-row left ``pads``."""

    start: int = 0
    pads: torch.Tensor | None = None  # [b] int64; None: no padding
    cache: KVCache | None = None
    examples: torch.Tensor | None = None  # [b, s] packed example of each token; None: one

    def __post_init__(self) -> None:
        training = self.start == 0 and self.pads is None and self.cache is None
        if self.examples is not None and not training:
            raise ValueError("packed examples are for training: from position 0, unpadded")

    @property
    def plain(self) -> bool:
        """Training's case: from position 0, unpadded, no cache (plain causal mask)."""
        return (
            self.start == 0 and self.pads is None and self.cache is None and self.examples is None
        )

    def ids(self, b: int, s: int, device: torch.device) -> torch.Tensor:
        """``[b, s]`` position of each token in its own sequence (pads count from 0) or,
        packed, in its own example."""
        ids = torch.arange(self.start, self.start + s, device=device).expand(b, s)
        if self.examples is not None:
            return ids - example_firsts(self.examples.to(device))
        if self.pads is None:
            return ids
        return (ids - self.pads.to(device)[:, None]).clamp(min=0)

    def mask(self, b: int, s: int, device: torch.device) -> torch.Tensor | None:
        """``[b, 1, s, start + s]`` keys each query may see (causal, not padding, in its
        own example)."""
        if self.plain:
            return None
        keys = torch.arange(self.start + s, device=device)
        queries = torch.arange(self.start, self.start + s, device=device)
        allowed = keys[None, :] <= queries[:, None]
        allowed = allowed.expand(b, s, self.start + s)
        if self.pads is not None:
            allowed = allowed & (keys[None, None, :] >= self.pads.to(device)[:, None, None])
        if self.examples is not None:
            examples = self.examples.to(device)
            allowed = allowed & (examples[:, :, None] == examples[:, None, :])
        return allowed[:, None]


def example_firsts(examples: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: the index of the first token of each token's example in its row
    (examples are runs of equal numbers)."""
    s = examples.shape[1]
    index = torch.arange(s, device=examples.device).expand_as(examples)
    new = torch.ones_like(examples, dtype=torch.bool)
    new[:, 1:] = examples[:, 1:] != examples[:, :-1]
    return torch.where(new, index, torch.zeros_like(index)).cummax(dim=1).values


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    where: Positions,
    layer: int,
) -> torch.Tensor:
    """Causal attention of ``q`` (``[b, heads, s, d]``) over ``k, v`` (fewer heads
    allowed: each serves ``heads / kv_heads`` consecutive query heads), through the cache
    when there is one; returns ``[b, s, heads * d]``."""
    b, heads, s, d = q.shape
    if where.cache is not None:
        k, v = where.cache.extend(layer, where.start, k, v)
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    mask = where.mask(b, s, q.device)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, s, heads * d)


def rope_frequencies(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding (``head_dim / 2`` of them), with Llama
    3's scaling when ``spec.rope_scaling_factor`` > 0: wavelengths longer than the
    original context over ``low_freq_factor`` are divided by ``factor``, shorter than it
    over ``high_freq_factor`` kept, and those between interpolated smoothly (the rule of
    Meta's Llama 3.1 reference code and of Hugging Face's ``rope_type: llama3``)."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    factor = spec.rope_scaling_factor
    if factor <= 0:
        return inv
    old = spec.rope_original_max_seq_len
    low, high = spec.rope_low_freq_factor, spec.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, 1, s, head_dim]`` cosines and sines for position ``ids`` (``[b, s]``), fp32."""
    angles = ids.float()[..., None] * inv_freq.to(ids.device)[None, None, :]
    both = torch.cat([angles, angles], dim=-1)[:, None]
    return both.cos(), both.sin()


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``t`` (``[b, heads, s, d]``) by pairs (i, i + d/2): the rotate-half
    convention of Hugging Face's Llama checkpoints, whose q/k rows are stored for it."""
    half = t.shape[-1] // 2
    rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return (t * cos + rotated * sin).to(t.dtype)
