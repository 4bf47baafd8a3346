"""The GPT of ``ModelSpec`` on AxoNN's 4D grid.

Learned positions, pre-LN blocks, GeLU MLP with ``ffn_mult * h`` hidden units, biases,
and an LM head tied to the token embedding. Parameter names double as the keys of
``full_state_dict``; the full tensors have the usual single-process shapes.

How a block is split over the grid and the throughput knobs: ``docs/job-side.md``
("train/models/gpt.py").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.train.parallel.attention import KVCache, Positions, attend
from axonn_launch.train.parallel.comm import FP32_WIRE, Comm, Wire
from axonn_launch.train.parallel.groups import Groups
from axonn_launch.train.parallel.init import init_shard
from axonn_launch.train.parallel.layers import (
    OverlapRuntime,
    TPLayerNorm,
    TPLinear,
    VocabParallelEmbedding,
)

TENSOR_PARALLEL_AXES = ("x", "y", "z")


def qkv_row_order(n_head: int, head_dim: int, y: int) -> torch.Tensor:
    """Full-weight rows in the order (y block, q/k/v, head, dim): splitting the output
    features over y hands each rank whole heads with their q, k and v, and within a
    rank's block the q, k and v rows stay three runs of consecutive full rows (so a
    shard is a few boxes of the natural q|k|v tensor, see train/parallel/shards.py)."""
    rows = torch.arange(3 * n_head * head_dim).view(3, y, n_head // y, head_dim)
    return rows.transpose(0, 1).reshape(-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, *, comm: Comm, runtime: OverlapRuntime, name: str,
                 device: torch.device | str, layer: int = 0) -> None:  # fmt: skip
        super().__init__()
        h = spec.d_model
        self.layer = layer
        if spec.n_head % comm.size("y"):
            raise ValueError(f"n_head={spec.n_head} is not divisible by y={comm.size('y')}")
        self.local_heads = spec.n_head // comm.size("y")
        self.head_dim = spec.head_dim
        self.qkv = TPLinear(
            h, 3 * h, comm=comm, runtime=runtime, transpose=False, name=f"{name}.qkv",
            row_order=qkv_row_order(spec.n_head, spec.head_dim, comm.size("y")), device=device,
        )  # fmt: skip
        self.proj = TPLinear(h, h, comm=comm, runtime=runtime, transpose=True,
                             name=f"{name}.proj", device=device)  # fmt: skip

    def forward(self, x: torch.Tensor, where: Positions) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.local_heads, self.head_dim)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [b, heads, s, d]
        return self.proj(attend(q, k, v, where, self.layer))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, *, comm: Comm, runtime: OverlapRuntime, name: str,
                 device: torch.device | str) -> None:  # fmt: skip
        super().__init__()
        h, f = spec.d_model, spec.d_ff
        self.up = TPLinear(h, f, comm=comm, runtime=runtime, transpose=False, name=f"{name}.up",
                           device=device)  # fmt: skip
        self.down = TPLinear(f, h, comm=comm, runtime=runtime, transpose=True,
                             name=f"{name}.down", device=device)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, *, comm: Comm, runtime: OverlapRuntime, name: str,
                 device: torch.device | str, layer: int = 0) -> None:  # fmt: skip
        super().__init__()
        h = spec.d_model
        self.ln1 = TPLayerNorm(h, comm=comm, name=f"{name}.ln1", device=device)
        self.attn = Attention(spec, comm=comm, runtime=runtime, name=f"{name}.attn",
                              device=device, layer=layer)  # fmt: skip
        self.ln2 = TPLayerNorm(h, comm=comm, name=f"{name}.ln2", device=device)
        self.mlp = MLP(spec, comm=comm, runtime=runtime, name=f"{name}.mlp", device=device)

    def linears(self) -> list[TPLinear]:
        """The block's Linears in forward order."""
        return [self.attn.qkv, self.attn.proj, self.mlp.up, self.mlp.down]

    def forward(self, x: torch.Tensor, where: Positions) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), where)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """One model replica's shard on this rank; see the module docstring.

    ``cache_layers`` (0..n_layer) and ``ors_window`` (>= 0) count transformer blocks;
    their ranges are checked by ``axonn_launch.common.rules.throughput_problem``.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        groups: Groups,
        overlap: OverlapConfig,
        activation_checkpointing: bool = False,
        seed: int = 0,
        device: torch.device | str = "cpu",
        wire: Wire = FP32_WIRE,
        cache_layers: int = 0,
        ors_window: int = 0,
        gemm_tuning: bool = False,
    ) -> None:
        super().__init__()
        self.spec, self.groups = spec, groups
        self.activation_checkpointing = activation_checkpointing
        self.comm = Comm(groups)
        self.runtime = OverlapRuntime(self.comm, overlap, wire=wire, gemm_tuning=gemm_tuning)
        self.embedding = VocabParallelEmbedding(
            spec.vocab_size, spec.max_seq_len, spec.d_model, comm=self.comm, device=device,
            wire=wire, positions=spec.architecture.learned_positions, tied=spec.tie_embeddings,
        )  # fmt: skip
        self.blocks = nn.ModuleList(self._block(i, device) for i in range(spec.n_layer))
        self.ln_f = self._norm("ln_f", device)
        cached = [layer for block in self.blocks[:cache_layers] for layer in block.linears()]
        self.runtime.set_plans(
            training=self._training_plan(), inference=self._forward_plan(), cached=cached
        )
        self.runtime.max_pending = ors_window * len(self.blocks[0].linears())
        self._initialize(seed)

    def _block(self, index: int, device: torch.device | str) -> nn.Module:
        return Block(self.spec, comm=self.comm, runtime=self.runtime, name=f"blocks.{index}",
                     device=device, layer=index)  # fmt: skip

    def _norm(self, name: str, device: torch.device | str) -> nn.Module:
        return TPLayerNorm(self.spec.d_model, comm=self.comm, name=name, device=device)

    def _forward_plan(self) -> list[TPLinear]:
        return [layer for block in self.blocks for layer in block.linears()]

    def _training_plan(self) -> list[TPLinear]:
        """Order of weight requests in forward + backward, with recompute if enabled."""
        plan = self._forward_plan()
        for block in reversed(self.blocks):
            if self.activation_checkpointing:
                plan += block.linears()
            plan += block.linears()[::-1]
        return plan

    @torch.no_grad()
    def _initialize(self, seed: int) -> None:
        # Each rank computes only its own elements, keyed by their place in the full
        # tensor, so every grid gets the same full weights (axonn_launch.train.parallel.init).
        for name, param in self.named_parameters():
            init_shard(param, name, self.groups, seed, self.spec.n_layer)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        normalizer: float | torch.Tensor | None = None,
        examples: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cross-entropy of this rank's counted labels (``targets`` other than
        ``layers.IGNORE_INDEX``) summed and divided by ``normalizer`` (None: their
        number, the local mean), or last-position logits ``[b, V]``. ``examples``
        (``[b, s]``): the packed example of each token, which attends only within it."""
        hidden, table = self._hidden(idx, Positions(examples=examples))
        if targets is None:
            return self.embedding.last_logits(hidden, self.embedding.head_table(table))
        return self.embedding.loss(hidden, self.embedding.head_table(table), targets, normalizer)

    @torch.no_grad()
    def all_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[b, s, V]`` of every position, on every rank."""
        hidden, table = self._hidden(idx, Positions())
        return self.embedding.logits(hidden, self.embedding.head_table(table))

    @torch.no_grad()
    def step_logits(
        self, idx: torch.Tensor, cache: KVCache, start: int, pads: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Generation: last-position logits ``[b, V]`` of ``idx`` (``[b, s]``, the tokens
        at positions ``start..``; rows left-padded by ``pads``), extending ``cache``."""
        hidden, table = self._hidden(idx, Positions(start=start, pads=pads, cache=cache))
        return self.embedding.last_logits(hidden, self.embedding.head_table(table))

    def _hidden(self, idx: torch.Tensor, where: Positions) -> tuple[torch.Tensor, torch.Tensor]:
        training = torch.is_grad_enabled()
        self.runtime.begin_micro_step(training=training)
        table = self.embedding.token_table()
        hidden = self._embed(idx, table, where)
        for block in self.blocks:
            if self.activation_checkpointing and training:
                hidden = checkpoint(block, hidden, where, use_reentrant=False)
            else:
                hidden = block(hidden, where)
        return self.ln_f(hidden), table

    def _embed(self, idx: torch.Tensor, table: torch.Tensor, where: Positions) -> torch.Tensor:
        positions = None if where.plain else where.ids(*idx.shape, idx.device)
        return self.embedding.embed(idx, table, positions)


# ---------------------------------------------------------------------------------------
# Gradient synchronization, clipping and full (unsharded) state


def finish_gradients(model: GPT, groups: Groups, *, average: bool = True) -> None:
    """Complete the gradients of all micro-steps of one optimizer step.

    Waits for deferred reduce-scatters, sums over z the gradients of parameters
    replicated over z (and over y those of repeated KV heads), sums over data, and with
    ``average`` divides by z*data: the gradient of the mean of the per-rank losses. The
    training loop divides each rank's loss by the step's global label count instead
    and passes ``average=False`` (``train/loop.py``).
    """
    model.runtime.flush_deferred_grads()
    model.runtime.drop_prefetched()
    params = list(model.parameters())
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    comm = model.comm
    over_z = [p.grad for p in params if "z" in p.shard_layout.replicated_over]
    _all_reduce_coalesced(comm, over_z, "z", "grad_sync")
    _sum_over_replicas(model, [p.grad for p in params if p.shard_layout.y_replicas > 1])
    _all_reduce_coalesced(comm, [p.grad for p in params], "data", "grad_sync")
    scale = 1.0 / (groups.grid.z * groups.grid.data)
    if average and scale != 1.0:
        torch._foreach_mul_([p.grad for p in params], scale)


def _sum_over_replicas(model: GPT, grads: list[torch.Tensor]) -> None:
    """Llama's KV weights repeated over y ranks (``llama.py``): sum their gradients."""
    group = getattr(model, "replica_group", None)
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    model.comm.all_reduce_in(flat, group, axis="y_replicas", tag="grad_sync")
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _all_reduce_coalesced(comm: Comm, tensors: list[torch.Tensor], axis: str, tag: str) -> None:
    if comm.size(axis) == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, axis, tag=tag)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _sum_over_tensor_parallel(comm: Comm, t: torch.Tensor, tag: str) -> torch.Tensor:
    for axis in TENSOR_PARALLEL_AXES:
        comm.all_reduce(t, axis, tag=tag)
    return t


def clip_grad_norm_(model: GPT, max_norm: float, groups: Groups) -> float:
    """Clip to the global L2 norm (each distinct element counted once); return the norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None and _owns(p, groups)]
    device = next(model.parameters()).device
    squares = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        squares += g.float().pow(2).sum()
    norm = _sum_over_tensor_parallel(model.comm, squares, "grad_norm").sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    all_grads = [p.grad for p in model.parameters() if p.grad is not None]
    if all_grads:
        torch._foreach_mul_(all_grads, coef.to(all_grads[0].dtype))
    return float(norm)


def _owns(param: nn.Parameter, groups: Groups) -> bool:
    return param.shard_layout.owns_copy(groups)


def _gather_full(model: GPT, groups: Groups, name: str, local: torch.Tensor) -> torch.Tensor:
    layout = model.get_parameter(name).shard_layout
    index = layout.full_indices(groups).to(local.device)
    full = torch.zeros(math.prod(layout.full_shape), dtype=local.dtype, device=local.device)
    if layout.owns_copy(groups):
        keep = index >= 0
        full[index[keep]] = local.reshape(-1)[keep]
    return _sum_over_tensor_parallel(model.comm, full, "full_state").view(layout.full_shape)


@torch.no_grad()
def full_state_dict(model: GPT, groups: Groups) -> dict[str, torch.Tensor]:
    """Unsharded parameters, identical on every rank (collective: call on all ranks)."""
    return {n: _gather_full(model, groups, n, p.detach()) for n, p in model.named_parameters()}


@torch.no_grad()
def full_grad_dict(model: GPT, groups: Groups) -> dict[str, torch.Tensor]:
    """Unsharded gradients, identical on every rank (collective: call on all ranks)."""
    return {
        n: _gather_full(model, groups, n, p.grad if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


@torch.no_grad()
def load_full_state_dict(model: GPT, groups: Groups, state: dict[str, torch.Tensor]) -> None:
    """Shard a full state (any grid's ``full_state_dict``) onto this rank's model."""
    names = {n for n, _ in model.named_parameters()}
    if names != set(state):
        missing, extra = sorted(names - set(state)), sorted(set(state) - names)
        raise KeyError(f"state dict mismatch: missing {missing}, unexpected {extra}")
    model.runtime.drop_prefetched()
    for name, param in model.named_parameters():
        full = state[name].to(device=param.device, dtype=param.dtype)
        param.copy_(param.shard_layout.local_from_full(full, groups))


def count_unique_params(model: GPT, groups: Groups) -> int:
    """Distinct parameter elements of one replica, summed over its tensor-parallel ranks."""
    owned = sum(
        int((p.shard_layout.full_indices(groups) >= 0).sum())
        for p in model.parameters()
        if _owns(p, groups)
    )
    device = next(model.parameters()).device
    total = torch.tensor(owned, dtype=torch.int64, device=device)
    return int(_sum_over_tensor_parallel(model.comm, total, "param_count").item())
