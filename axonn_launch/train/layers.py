"""AxoNN's tensor-parallel building blocks on ``torch.distributed``.

* ``TPLinear``: the 3D tensor-parallel Linear. The weight W (out x in) is split into
  blocks over the inner group (columns) and the outer group (rows), and each block is
  flattened and split again over z. Non-transposed: inner = x, outer = y; transposed:
  inner = y, outer = x, so a non-transposed layer feeds a transposed one with no
  re-distribution. Forward: all-gather W over z, GEMM, all-reduce over inner.
  Backward: all-gather W over z again (nothing but the z shard is kept between the
  passes), dX GEMM, all-reduce dX over outer, dW GEMM, reduce-scatter dW over z.
* ``OverlapRuntime``: the three switchable overlaps of the AxoNN paper (OAR, ORS, OAG).
* ``TPLayerNorm``: LayerNorm over a hidden dimension split over x, exact because the
  mean and variance are all-reduced over x.
* ``VocabParallelEmbedding``: token embedding split by vocab rows over the x*y plane
  and flattened over z, position embedding split by columns over x, the tied LM head
  and the vocab-parallel cross-entropy.

Activations between layers are ``[batch, seq, h/x]``, replicated over y.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from axonn_launch.spec import OverlapConfig
from axonn_launch.train.comm import Comm, Handle
from axonn_launch.train.groups import Groups

# ---------------------------------------------------------------------------------------
# How a parameter's local shard is cut from the full tensor


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """Maps a full parameter to this rank's shard.

    The full tensor is first re-ordered along dim 0 (``row_order``) and padded with
    rows (``pad_rows_to``); then chunked along ``dim`` over ``axis`` for each entry of
    ``splits``; then, if ``flatten_over_z``, flattened and chunked over z.
    ``replicated_over`` lists the tensor-parallel axes (x, y, z) over which the shard is
    the same on every rank: such parameters need their gradient summed over z when z is
    among them, and only the rank at index 0 of those axes counts them in norms.
    """

    full_shape: tuple[int, ...]
    splits: tuple[tuple[int, str], ...]
    flatten_over_z: bool
    replicated_over: tuple[str, ...]
    row_order: torch.Tensor | None = None
    pad_rows_to: int | None = None

    def local_from_full(self, full: torch.Tensor, groups: Groups, fill: float = 0) -> torch.Tensor:
        if tuple(full.shape) != self.full_shape:
            raise ValueError(
                f"expected a tensor of shape {self.full_shape}, got {tuple(full.shape)}"
            )
        if self.row_order is not None:
            full = full.index_select(0, self.row_order.to(full.device))
        if self.pad_rows_to is not None and self.pad_rows_to > full.shape[0]:
            pad = full.new_full((self.pad_rows_to - full.shape[0], *full.shape[1:]), fill)
            full = torch.cat([full, pad])
        for dim, axis in self.splits:
            full = full.chunk(groups.size(axis), dim=dim)[groups.index(axis)]
        if self.flatten_over_z:
            full = full.reshape(-1).chunk(groups.size("z"))[groups.index("z")]
        return full.contiguous()

    def full_indices(self, groups: Groups) -> torch.Tensor:
        """Flat positions in the full tensor of this rank's shard elements (-1 = padding)."""
        numel = math.prod(self.full_shape)
        positions = torch.arange(numel, dtype=torch.int64).reshape(self.full_shape)
        return self.local_from_full(positions, groups, fill=-1).reshape(-1)

    def owns_copy(self, groups: Groups) -> bool:
        """True on exactly one rank among those holding the same shard in a replica."""
        return all(groups.index(axis) == 0 for axis in self.replicated_over)


def set_layout(param: nn.Parameter, layout: ShardLayout) -> nn.Parameter:
    param.shard_layout = layout
    return param


def _chunk_or_fail(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what}={size} is not divisible by {parts}")
    return size // parts


# ---------------------------------------------------------------------------------------
# Overlap runtime: prefetched weight all-gathers and deferred weight-grad reduce-scatters


class OverlapRuntime:
    """State of the overlaps for one model, shared by its ``TPLinear`` layers.

    OAG: the model gives the order in which layers will ask for their gathered weights
    during a micro-step (``set_plans``); whenever a layer takes its weight, the all-gather
    of the next layer in that order is started. A layer that was not prefetched gathers
    synchronously, so a wrong guess only costs time. ORS: weight-grad reduce-scatters
    are started in backward and waited in ``flush_deferred_grads`` (the start of the next
    forward, or ``finish_gradients``), where the shard is added to ``param.grad``.
    """

    def __init__(self, comm: Comm, overlap: OverlapConfig) -> None:
        self.comm = comm
        self.overlap = overlap
        self._plans: dict[bool, list[TPLinear]] = {True: [], False: []}
        self._schedule: list[TPLinear] = []
        self._cursor = 0
        self._prefetched: dict[int, tuple[torch.Tensor, Handle]] = {}
        self._deferred: list[tuple[nn.Parameter, torch.Tensor, Handle]] = []

    def set_plans(self, *, training: list[TPLinear], inference: list[TPLinear]) -> None:
        self._plans = {True: list(training), False: list(inference)}

    def begin_micro_step(self, *, training: bool) -> None:
        """Start of a forward: settle pending work, then prefetch the first weight."""
        self.flush_deferred_grads()
        self.drop_prefetched()
        self._schedule = self._plans[training]
        self._cursor = 0
        if self.overlap.all_gather and self._schedule:
            self._prefetch(self._schedule[0])

    def gathered_weight(self, layer: TPLinear) -> torch.Tensor:
        position = self._advance_to(layer)
        entry = self._prefetched.pop(id(layer), None)
        if entry is None:
            flat, _ = layer.gather_weight(async_op=False)
        else:
            flat, handle = entry
            handle.wait()
        if self.overlap.all_gather and position is not None and position + 1 < len(self._schedule):
            self._prefetch(self._schedule[position + 1])
        return flat.view(layer.block_shape)

    def _advance_to(self, layer: TPLinear) -> int | None:
        for position in range(self._cursor, len(self._schedule)):
            if self._schedule[position] is layer:
                self._cursor = position + 1
                return position
        return None

    def _prefetch(self, layer: TPLinear) -> None:
        if id(layer) not in self._prefetched:
            self._prefetched[id(layer)] = layer.gather_weight(async_op=True)

    def drop_prefetched(self) -> None:
        for _, handle in self._prefetched.values():
            handle.wait()
        self._prefetched.clear()

    def defer(self, param: nn.Parameter, grad: torch.Tensor, handle: Handle) -> None:
        self._deferred.append((param, grad, handle))

    def flush_deferred_grads(self) -> None:
        for param, grad, handle in self._deferred:
            handle.wait()
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        self._deferred.clear()


# ---------------------------------------------------------------------------------------
# The 3D tensor-parallel Linear


class _TPLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_shard: torch.Tensor, layer: TPLinear):
        # What torch.amp.custom_fwd records, for the device the tensors are on (CPU or GPU)
        kind = x.device.type
        ctx.amp = dict(device_type=kind, enabled=torch.is_autocast_enabled(kind))
        ctx.amp["dtype"] = torch.get_autocast_dtype(kind)
        w = layer.runtime.gathered_weight(layer)
        y = x.reshape(-1, x.shape[-1]) @ w.t()
        layer.comm.all_reduce(y, layer.inner, tag=layer.name)
        ctx.save_for_backward(x)
        ctx.layer = layer
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        with torch.autocast(**ctx.amp):  # the forward's autocast state, as custom_bwd does
            dx, dw = ctx.layer.backward_pass(x, dy)
        return dx, dw, None


class TPLinear(nn.Module):
    """Y = X W^T + b with W split over (outer, inner) and each block flattened over z.

    Input ``[..., in/G_inner]`` (replicated over outer), output ``[..., out/G_outer]``
    (replicated over inner). ``row_order`` permutes the output features of the full
    weight before sharding (used to keep each attention head's q, k and v together).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        comm: Comm,
        runtime: OverlapRuntime,
        transpose: bool = False,
        bias: bool = True,
        name: str = "",
        row_order: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.comm, self.runtime, self.name = comm, runtime, name
        self.transpose = transpose
        self.inner, self.outer = ("y", "x") if transpose else ("x", "y")
        self.in_features, self.out_features = in_features, out_features
        out_local = _chunk_or_fail(out_features, comm.size(self.outer), f"{name} out_features")
        in_local = _chunk_or_fail(in_features, comm.size(self.inner), f"{name} in_features")
        self.block_shape = (out_local, in_local)
        shard = _chunk_or_fail(out_local * in_local, comm.size("z"), f"{name} weight block")
        self.weight = set_layout(
            nn.Parameter(torch.empty(shard, device=device)),
            ShardLayout(
                full_shape=(out_features, in_features),
                splits=((0, self.outer), (1, self.inner)),
                flatten_over_z=True,
                replicated_over=(),
                row_order=row_order,
            ),
        )
        self.bias = None
        if bias:
            self.bias = set_layout(
                nn.Parameter(torch.zeros(out_local, device=device)),
                ShardLayout(
                    full_shape=(out_features,),
                    splits=((0, self.outer),),
                    flatten_over_z=False,
                    replicated_over=(self.inner, "z"),
                    row_order=row_order,
                ),
            )

    def gather_weight(self, *, async_op: bool) -> tuple[torch.Tensor, Handle]:
        return self.comm.all_gather(
            self.weight.detach(), "z", tag=self.name, async_op=async_op, group_name="z_gather"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _TPLinearFunction.apply(x, self.weight, self)
        return y if self.bias is None else y + self.bias

    def backward_pass(
        self, x: torch.Tensor, dy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Input and weight-shard gradients; the latter is None when deferred (ORS)."""
        overlap = self.runtime.overlap
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        early_rs = overlap.reduce_scatter and self.comm.size(self.outer) == 1
        dw = self._weight_grad(dy2, x2) if early_rs else None  # RS overlaps the dX GEMM
        w = self.runtime.gathered_weight(self)
        dx = (dy2 @ w).to(x.dtype)
        handle = self.comm.all_reduce(
            dx, self.outer, tag=self.name, async_op=overlap.all_reduce
        )  # OAR: overlaps the dW GEMM below
        if not early_rs:
            dw = self._weight_grad(dy2, x2)
        handle.wait()
        return dx.view(x.shape), dw

    def _weight_grad(self, dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor | None:
        full = (dy2.t() @ x2).to(self.weight.dtype).reshape(-1)
        deferred = self.runtime.overlap.reduce_scatter and self.comm.size("z") > 1
        shard, handle = self.comm.reduce_scatter(full, "z", tag=self.name, async_op=deferred)
        if deferred:
            self.runtime.defer(self.weight, shard, handle)
            return None
        return shard


# ---------------------------------------------------------------------------------------
# Autograd-aware collectives for the layers around the Linears


class _AllReduceSum(torch.autograd.Function):
    """Sum over an axis whose members then use the result differently: the backward
    also sums (each member's input influences every member's output)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Comm, axis: str, tag: str):
        ctx.comm, ctx.axis, ctx.tag = comm, axis, tag
        out = t.clone()
        comm.all_reduce(out, axis, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        ctx.comm.all_reduce(grad, ctx.axis, tag=ctx.tag)
        return grad, None, None, None


def _gather_last_dim(t: torch.Tensor, comm: Comm, axis: str, tag: str) -> torch.Tensor:
    gathered, _ = comm.all_gather(t.movedim(-1, 0).contiguous(), axis, tag=tag)
    return gathered.movedim(0, -1).contiguous()


def _slice_last_dim(t: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    return t.chunk(comm.size(axis), dim=-1)[comm.index(axis)].contiguous()


class _PlaneSumToHidden(torch.autograd.Function):
    """Vocab-parallel lookups summed over the plane, then this rank's x slice of h.
    Backward: every plane member needs the gradient of all h columns (all-gather over x)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, comm: Comm):
        ctx.comm = comm
        full = partial.clone()
        comm.all_reduce(full, "plane", tag="embedding")
        return _slice_last_dim(full, comm, "x")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_last_dim(grad, ctx.comm, "x", "embedding"), None


class _HiddenToPlane(torch.autograd.Function):
    """Full hidden vector for the vocab-parallel head: all-gather over x. Backward: each
    plane member holds the gradient from its vocab rows only, so sum over the plane."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, comm: Comm):
        ctx.comm = comm
        return _gather_last_dim(hidden, comm, "x", "lm_head")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, "plane", tag="lm_head")
        return _slice_last_dim(grad, ctx.comm, "x"), None


class _GatherOverZ(torch.autograd.Function):
    """Flat z shard -> full block (all-gather); backward: reduce-scatter over z."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, comm: Comm, tag: str):
        ctx.comm, ctx.tag = comm, tag
        full, _ = comm.all_gather(shard.detach(), "z", tag=tag)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard, _ = ctx.comm.reduce_scatter(grad.contiguous().clone(), "z", tag=ctx.tag)
        return shard, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocab columns over the plane.

    Columns at or beyond ``vocab_size`` are padding and never win or receive gradient.
    """

    @staticmethod
    def forward(ctx, logits, targets, comm: Comm, vocab_start: int, vocab_size: int):
        logits = logits.float()
        columns = torch.arange(vocab_start, vocab_start + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
        peak = logits.max(dim=-1).values
        comm.all_reduce(peak, "plane", tag="cross_entropy", op="max")
        exp = (logits - peak[:, None]).exp()
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < logits.shape[-1])
        safe_target = local_target.clamp(0, logits.shape[-1] - 1)
        target_logit = (logits - peak[:, None]).gather(1, safe_target[:, None]).squeeze(1)
        stats = torch.stack([exp.sum(dim=-1), torch.where(mine, target_logit, 0.0)])
        comm.all_reduce(stats, "plane", tag="cross_entropy")
        sum_exp, target_logit = stats[0], stats[1]
        ctx.save_for_backward(exp / sum_exp[:, None], safe_target, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_target, mine = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, safe_target] -= mine.to(grad.dtype)
        return grad * grad_loss[:, None], None, None, None, None


# ---------------------------------------------------------------------------------------
# LayerNorm and embeddings


class TPLayerNorm(nn.Module):
    """LayerNorm over h for activations holding h/x features; statistics reduced over x."""

    def __init__(self, hidden: int, *, comm: Comm, name: str = "", eps: float = 1e-5,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        super().__init__()
        self.comm, self.name, self.hidden, self.eps = comm, name, hidden, eps
        local = _chunk_or_fail(hidden, comm.size("x"), f"{name} hidden")
        layout = ShardLayout(
            full_shape=(hidden,), splits=((0, "x"),), flatten_over_z=False,
            replicated_over=("y", "z"),
        )  # fmt: skip
        self.weight = set_layout(nn.Parameter(torch.ones(local, device=device)), layout)
        self.bias = set_layout(nn.Parameter(torch.zeros(local, device=device)), layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.size("x") == 1:
            return F.layer_norm(x, (self.hidden,), self.weight, self.bias, self.eps)
        xf = x.float()
        sums = torch.stack([xf.sum(dim=-1), (xf * xf).sum(dim=-1)], dim=-1)
        sums = _AllReduceSum.apply(sums, self.comm, "x", self.name)
        mean = sums[..., 0:1] / self.hidden
        var = (sums[..., 1:2] / self.hidden - mean * mean).clamp_min(0.0)
        normed = (xf - mean) * torch.rsqrt(var + self.eps)
        return (normed * self.weight + self.bias).to(x.dtype)


class VocabParallelEmbedding(nn.Module):
    """Token + learned position embeddings, and the tied LM head with its loss.

    The token table (V x h) is padded with zero rows to a multiple of x*y; plane member
    p = x + G_x*y holds rows [p*V_l, (p+1)*V_l) with all h columns, flattened and split
    over z. The position table (S x h) is split by columns over x.
    """

    def __init__(self, vocab_size: int, max_seq_len: int, hidden: int, *, comm: Comm,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        super().__init__()
        self.comm, self.vocab_size, self.hidden = comm, vocab_size, hidden
        plane = comm.size("plane")
        self.padded_vocab = -(-vocab_size // plane) * plane
        self.local_vocab = self.padded_vocab // plane
        self.vocab_start = comm.index("plane") * self.local_vocab
        shard = _chunk_or_fail(self.local_vocab * hidden, comm.size("z"), "token table block")
        self.wte = set_layout(
            nn.Parameter(torch.empty(shard, device=device)),
            ShardLayout(
                full_shape=(vocab_size, hidden), splits=((0, "plane"),), flatten_over_z=True,
                replicated_over=(), pad_rows_to=self.padded_vocab,
            ),
        )  # fmt: skip
        local_hidden = _chunk_or_fail(hidden, comm.size("x"), "hidden")
        self.wpe = set_layout(
            nn.Parameter(torch.empty(max_seq_len, local_hidden, device=device)),
            ShardLayout(
                full_shape=(max_seq_len, hidden), splits=((1, "x"),), flatten_over_z=False,
                replicated_over=("y", "z"),
            ),
        )  # fmt: skip

    def token_table(self) -> torch.Tensor:
        """This plane member's vocab rows ``[V_l, h]``, gathered over z (differentiable)."""
        if self.comm.size("z") == 1:
            return self.wte.view(self.local_vocab, self.hidden)
        block = _GatherOverZ.apply(self.wte, self.comm, "wte")
        return block.view(self.local_vocab, self.hidden)

    def embed(self, idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` token ids -> ``[b, s, h/x]`` hidden states."""
        local = idx - self.vocab_start
        mine = (local >= 0) & (local < self.local_vocab)
        partial = F.embedding(local.clamp(0, self.local_vocab - 1), table)
        partial = partial * mine.unsqueeze(-1).to(partial.dtype)
        hidden = _PlaneSumToHidden.apply(partial, self.comm)
        return hidden + self.wpe[: idx.shape[1]]

    def loss(
        self, hidden: torch.Tensor, table: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """Mean cross-entropy over the local tokens (same value on every plane member)."""
        full = _HiddenToPlane.apply(hidden, self.comm)
        logits = full.reshape(-1, self.hidden) @ table.t()
        per_token = _VocabParallelCrossEntropy.apply(
            logits, targets.reshape(-1), self.comm, self.vocab_start, self.vocab_size
        )
        return per_token.mean()

    @torch.no_grad()
    def last_logits(self, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[b, V]`` of the last position."""
        full = _gather_last_dim(hidden[:, -1], self.comm, "x", "lm_head")
        local = full @ table.t()  # [b, V_l]
        gathered, _ = self.comm.all_gather(local.t().contiguous(), "plane", tag="lm_head")
        return gathered.t()[:, : self.vocab_size].contiguous()
