"""The Llama of ``ModelSpec(arch="llama")`` on AxoNN's 4D grid.

RMSNorm, rotary positions (with Llama 3's scaling), grouped-query attention, a SwiGLU
MLP, no biases, and an LM head of its own unless ``tie_embeddings``. Everything else
(the overlap runtime, the vocab-parallel embedding and loss, initialization, sharded
checkpoints, gradient synchronization) is the GPT's, in ``train/models/gpt.py``.

Its Linears, their Hugging Face row ranges and the KV heads over y:
``docs/job-side.md`` ("train/models/llama.py").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.train.models.gpt import GPT
from axonn_launch.train.parallel.attention import (
    Positions,
    apply_rope,
    attend,
    rope_cos_sin,
    rope_frequencies,
)
from axonn_launch.train.parallel.comm import Comm
from axonn_launch.train.parallel.layers import OverlapRuntime, TPLinear, TPRMSNorm


def kv_split(kv_heads: int, y: int) -> tuple[int, int]:
    """(parts the KV heads are split into, y ranks holding each part)."""
    if kv_heads % y == 0:
        return y, 1
    if y % kv_heads == 0:
        return kv_heads, y // kv_heads
    raise ValueError(f"model.n_kv_head={kv_heads} and grid.y={y}: one must divide the other")


def grouped_rows(groups: int, parts: int, per_group: int) -> torch.Tensor:
    """Rows of ``groups`` stacked tensors (e.g. k|v) of ``parts * per_group`` rows each,
    ordered (part, group, row): each part of a split over y gets its rows of every group
    as consecutive runs."""
    rows = torch.arange(groups * parts * per_group).view(groups, parts, per_group)
    return rows.transpose(0, 1).reshape(-1)


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, *, comm: Comm, runtime: OverlapRuntime, name: str,
                 device: torch.device | str, layer: int,
                 inv_freq: torch.Tensor) -> None:  # fmt: skip
        super().__init__()
        h, hd, y = spec.d_model, spec.head_dim, comm.size("y")
        if spec.n_head % y:
            raise ValueError(f"n_head={spec.n_head} is not divisible by y={y}")
        parts, replicas = kv_split(spec.kv_heads, y)
        self.layer, self.head_dim, self.inv_freq = layer, hd, inv_freq
        self.local_heads, self.local_kv = spec.n_head // y, spec.kv_heads // parts
        linear = dict(comm=comm, runtime=runtime, bias=False, device=device)
        self.q = TPLinear(h, spec.n_head * hd, transpose=False, name=f"{name}.q", **linear)
        self.kv = TPLinear(
            h, 2 * spec.kv_heads * hd, transpose=False, name=f"{name}.kv",
            row_order=grouped_rows(2, parts, spec.kv_heads // parts * hd), y_replicas=replicas,
            **linear,
        )  # fmt: skip
        self.proj = TPLinear(spec.n_head * hd, h, transpose=True, name=f"{name}.proj", **linear)

    def forward(self, x: torch.Tensor, where: Positions) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        kv = self.kv(x).view(b, s, 2, self.local_kv, self.head_dim)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        cos, sin = rope_cos_sin(self.inv_freq, where.ids(b, s, x.device))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.proj(attend(q, k, v, where, self.layer))


class SwiGLU(nn.Module):
    def __init__(self, spec: ModelSpec, *, comm: Comm, runtime: OverlapRuntime, name: str,
                 device: torch.device | str) -> None:  # fmt: skip
        super().__init__()
        h, f, y = spec.d_model, spec.d_ff, comm.size("y")
        if f % y:
            raise ValueError(f"ffn_hidden={f} is not divisible by y={y}")
        linear = dict(comm=comm, runtime=runtime, bias=False, device=device)
        self.gate_up = TPLinear(h, 2 * f, transpose=False, name=f"{name}.gate_up",
                                row_order=grouped_rows(2, y, f // y), **linear)  # fmt: skip
        self.down = TPLinear(f, h, transpose=True, name=f"{name}.down", **linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).unflatten(-1, (2, -1)).unbind(-2)
        return self.down(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self, spec: ModelSpec, *, comm: Comm, runtime: OverlapRuntime, name: str,
                 device: torch.device | str, layer: int,
                 inv_freq: torch.Tensor) -> None:  # fmt: skip
        super().__init__()
        h, eps = spec.d_model, spec.norm_eps
        self.ln1 = TPRMSNorm(h, comm=comm, name=f"{name}.ln1", eps=eps, device=device)
        self.attn = LlamaAttention(spec, comm=comm, runtime=runtime, name=f"{name}.attn",
                                   device=device, layer=layer, inv_freq=inv_freq)  # fmt: skip
        self.ln2 = TPRMSNorm(h, comm=comm, name=f"{name}.ln2", eps=eps, device=device)
        self.mlp = SwiGLU(spec, comm=comm, runtime=runtime, name=f"{name}.mlp", device=device)

    def linears(self) -> list[TPLinear]:
        """The block's Linears in forward order."""
        return [self.attn.q, self.attn.kv, self.attn.proj, self.mlp.gate_up, self.mlp.down]

    def forward(self, x: torch.Tensor, where: Positions) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), where)
        return x + self.mlp(self.ln2(x))


class Llama(GPT):
    """One replica's shard of a Llama on this rank (see the module docstring); built,
    trained, checkpointed and sampled exactly as ``GPT`` is."""

    def __init__(self, spec: ModelSpec, **kwargs) -> None:
        device = kwargs.get("device", "cpu")
        self._inv_freq = rope_frequencies(spec).to(device)
        super().__init__(spec, **kwargs)
        self.replica_group = _replica_group(self.groups.grid, self.groups.rank, spec.kv_heads)

    def _block(self, index: int, device: torch.device | str) -> nn.Module:
        return LlamaBlock(self.spec, comm=self.comm, runtime=self.runtime, name=f"blocks.{index}",
                          device=device, layer=index, inv_freq=self._inv_freq)  # fmt: skip

    def _norm(self, name: str, device: torch.device | str) -> nn.Module:
        return TPRMSNorm(self.spec.d_model, comm=self.comm, name=name, eps=self.spec.norm_eps,
                         device=device)  # fmt: skip


def _replica_group(grid: Grid, rank: int, kv_heads: int) -> dist.ProcessGroup | None:
    """The y ranks holding the same KV heads as this one (None when none repeat). A
    collective: every rank creates every group, in the same order."""
    _, replicas = kv_split(kv_heads, grid.y)
    if replicas == 1:
        return None
    own = None
    for ranks in grid.groups("y"):
        for first in range(0, len(ranks), replicas):
            members = ranks[first : first + replicas]
            group = dist.new_group(members)
            if rank in members:
                own = group
    return own
