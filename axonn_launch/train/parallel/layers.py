"""AxoNN's tensor-parallel building blocks on ``torch.distributed``.

``TPLinear`` (the 3D tensor-parallel Linear), ``OverlapRuntime`` (the overlaps, weight
cache, wire dtypes and GEMM tuner of one model), ``TPLayerNorm`` and
``VocabParallelEmbedding``. Activations between layers are ``[batch, seq, h/x]``,
replicated over y.

How each splits its tensors and what it sends, wire dtypes and weight caching:
``docs/job-side.md`` ("train/parallel/layers.py").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from axonn_launch.common.spec import OverlapConfig
from axonn_launch.train.parallel.comm import FP32_WIRE, Comm, Handle, Wire
from axonn_launch.train.parallel.gemm import GemmTuner
from axonn_launch.train.parallel.groups import Groups

IGNORE_INDEX = -100  # a target that does not count in the loss (cross_entropy's default)


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
    # > 1: the split over y has size(y) / y_replicas parts, each held by y_replicas
    # consecutive y ranks (Llama's KV heads when y exceeds their number)
    y_replicas: int = 1

    def split(self, axis: str, groups: Groups) -> tuple[int, int]:
        """(parts, this rank's part) of the split over ``axis``."""
        if axis == "y" and self.y_replicas > 1:
            return groups.size("y") // self.y_replicas, groups.index("y") // self.y_replicas
        return groups.size(axis), groups.index(axis)

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
            parts, index = self.split(axis, groups)
            full = full.chunk(parts, dim=dim)[index]
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
        if groups.index("y") % self.y_replicas:
            return False
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


# What a scheduled weight request does with the weight cache
GATHER, KEEP, REUSE, RELEASE = "gather", "keep", "reuse", "release"


@dataclass(frozen=True)
class _Request:
    layer: TPLinear
    action: str  # GATHER | KEEP (gather and cache) | REUSE (cached) | RELEASE (cached, last use)
    next_gather: int | None  # the next position in the schedule that gathers (OAG)


def _cache_actions(plan: list[TPLinear], cached: list[TPLinear]) -> list[str]:
    """A cached layer gathers at its first request, reads the cache at the later ones
    and frees it at its last. An uncached layer requested three times (forward,
    activation-checkpointing recompute, backward) keeps its recompute gather for the
    backward that follows it, as AxoNN's code saves the gathered block: one block's
    weights at a time, and three z collectives per Linear instead of four. Every other
    request gathers."""
    cached_ids = {id(layer) for layer in cached}
    positions: dict[int, list[int]] = {}
    for position, layer in enumerate(plan):
        positions.setdefault(id(layer), []).append(position)
    actions = [GATHER] * len(plan)
    for key, where in positions.items():
        if key in cached_ids and len(where) > 1:
            actions[where[0]] = KEEP
            for position in where[1:-1]:
                actions[position] = REUSE
            actions[where[-1]] = RELEASE
        elif len(where) >= 3:
            actions[where[-2]], actions[where[-1]] = KEEP, RELEASE
    return actions


def _schedule(plan: list[TPLinear], cached: list[TPLinear]) -> list[_Request]:
    """The plan's requests with their cache action and the next request that gathers."""
    actions = _cache_actions(plan, cached)
    requests: list[_Request] = []
    upcoming = None
    for position in reversed(range(len(plan))):
        requests.append(_Request(plan[position], actions[position], upcoming))
        if actions[position] in (GATHER, KEEP):
            upcoming = position
    return requests[::-1]


class OverlapRuntime:
    """State of the overlaps for one model, shared by its ``TPLinear`` layers.

    OAG: the model gives the order in which layers will ask for their gathered weights
    during a micro-step (``set_plans``); whenever a layer takes its weight, the all-gather
    of the next request in that order that gathers is started. A layer that was not
    prefetched gathers synchronously, so a wrong guess only costs time. ORS:
    weight-grad reduce-scatters are started in backward and waited in
    ``flush_deferred_grads`` (the start of the next forward, or ``finish_gradients``),
    where the shard is added to ``param.grad``; with ``max_pending`` > 0, starting one
    more than that many waits the oldest first, in order (0 = no bound). Adding the same
    shards in the same order, the bound does not change any gradient bit.
    """

    def __init__(
        self,
        comm: Comm,
        overlap: OverlapConfig,
        *,
        wire: Wire = FP32_WIRE,
        max_pending: int = 0,
        gemm_tuning: bool = False,
    ) -> None:
        self.comm = comm
        self.overlap = overlap
        self.wire = wire
        self.max_pending = max_pending
        self.peak_pending = 0  # most reduce-scatters pending at once so far (a measurement)
        self.tuner = GemmTuner(enabled=gemm_tuning)
        self._plans: dict[bool, list[_Request]] = {True: [], False: []}
        self._schedule: list[_Request] = []
        self._cursor = 0
        self._prefetched: dict[int, tuple[torch.Tensor, Handle]] = {}
        self._cache: dict[int, torch.Tensor] = {}
        self._deferred: deque[tuple[nn.Parameter, torch.Tensor, Handle]] = deque()

    def set_plans(
        self, *, training: list[TPLinear], inference: list[TPLinear],
        cached: list[TPLinear] = (),
    ) -> None:  # fmt: skip
        """Request orders of a training and an inference micro-step; ``cached`` layers
        keep their gathered weight through a training micro-step."""
        self._plans = {True: _schedule(list(training), list(cached)),
                       False: _schedule(list(inference), [])}  # fmt: skip

    def begin_micro_step(self, *, training: bool) -> None:
        """Start of a forward: settle pending work, then prefetch the first weight."""
        self.flush_deferred_grads()
        self.drop_prefetched()
        self._schedule = self._plans[training]
        self._cursor = 0
        if self.overlap.all_gather and self._schedule:
            self._prefetch(self._schedule[0].layer)

    @property
    def cached_bytes(self) -> int:
        """Bytes of the gathered weight blocks held in the cache now."""
        return sum(flat.numel() * flat.element_size() for flat in self._cache.values())

    def gathered_weight(self, layer: TPLinear) -> torch.Tensor:
        position = self._advance_to(layer)
        action = GATHER if position is None else self._schedule[position].action
        flat = self._cache.get(id(layer))
        if flat is not None and action == RELEASE:
            del self._cache[id(layer)]
        if flat is None:
            flat = self._take_gathered(layer)
            if action == KEEP:
                self._cache[id(layer)] = flat
        if self.overlap.all_gather and position is not None:
            upcoming = self._schedule[position].next_gather
            if upcoming is not None:
                self._prefetch(self._schedule[upcoming].layer)
        return flat.view(layer.block_shape)

    def _take_gathered(self, layer: TPLinear) -> torch.Tensor:
        entry = self._prefetched.pop(id(layer), None)
        if entry is None:
            flat, _ = layer.gather_weight(async_op=False)
            return flat
        flat, handle = entry
        handle.wait()
        return flat

    def _advance_to(self, layer: TPLinear) -> int | None:
        for position in range(self._cursor, len(self._schedule)):
            if self._schedule[position].layer is layer:
                self._cursor = position + 1
                return position
        return None

    def _prefetch(self, layer: TPLinear) -> None:
        if id(layer) not in self._prefetched:
            self._prefetched[id(layer)] = layer.gather_weight(async_op=True)

    def drop_prefetched(self) -> None:
        """Wait for prefetches and drop them and every cached weight (weights may change)."""
        for _, handle in self._prefetched.values():
            handle.wait()
        self._prefetched.clear()
        self._cache.clear()

    def defer(self, param: nn.Parameter, grad: torch.Tensor, handle: Handle) -> None:
        self._deferred.append((param, grad, handle))
        while self.max_pending and len(self._deferred) > self.max_pending:
            self._settle(*self._deferred.popleft())
        self.peak_pending = max(self.peak_pending, len(self._deferred))

    def flush_deferred_grads(self) -> None:
        while self._deferred:
            self._settle(*self._deferred.popleft())

    @staticmethod
    def _settle(param: nn.Parameter, grad: torch.Tensor, handle: Handle) -> None:
        """Wait for one reduce-scatter and add its shard (any wire dtype) to param.grad."""
        handle.wait()
        if param.grad is None:
            param.grad = grad.to(param.dtype)
        else:
            param.grad.add_(grad)


# ---------------------------------------------------------------------------------------
# The 3D tensor-parallel Linear


class _TPLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_shard: torch.Tensor, layer: TPLinear):
        # What torch.amp.custom_fwd records, for the device the tensors are on (CPU or GPU)
        kind = x.device.type
        ctx.amp = dict(device_type=kind, enabled=torch.is_autocast_enabled(kind))
        ctx.amp["dtype"] = torch.get_autocast_dtype(kind)
        w = layer.gemm_weight(x)
        y = layer.runtime.tuner.mm("fwd", x.reshape(-1, x.shape[-1]), w.t())
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
        y_replicas: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.comm, self.runtime, self.name = comm, runtime, name
        self.transpose = transpose
        self.inner, self.outer = ("y", "x") if transpose else ("x", "y")
        self.in_features, self.out_features = in_features, out_features
        if y_replicas > 1 and transpose:
            raise ValueError(f"{name}: only a non-transposed layer's rows can repeat over y")
        out_parts = comm.size(self.outer) // y_replicas
        out_local = _chunk_or_fail(out_features, out_parts, f"{name} out_features")
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
                y_replicas=y_replicas,
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
        """The flat weight block, all-gathered over z in the wire dtype."""
        return self.comm.all_gather(
            self.weight.detach(), "z", tag=self.name, async_op=async_op, group_name="z_gather",
            dtype=self.runtime.wire.all_gather,
        )  # fmt: skip

    def gemm_weight(self, like: torch.Tensor) -> torch.Tensor:
        """The gathered block as a GEMM operand next to ``like``: under autocast the GEMM
        casts it itself; otherwise it takes ``like``'s dtype (a bf16 wire in fp32 runs)."""
        w = self.runtime.gathered_weight(self)
        return w if torch.is_autocast_enabled(like.device.type) else w.to(like.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _TPLinearFunction.apply(x, self.weight, self)
        return y if self.bias is None else y + self.bias

    def backward_pass(
        self, x: torch.Tensor, dy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Input and weight-shard gradients; the latter is None when deferred (ORS)."""
        runtime = self.runtime
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        early_rs = runtime.overlap.reduce_scatter and self.comm.size(self.outer) == 1
        dw = self._weight_grad(dy2, x2) if early_rs else None  # RS overlaps the dX GEMM
        dx, handle = self.comm.all_reduce_as(
            runtime.tuner.mm("dx", dy2, self.gemm_weight(dy2)), self.outer,
            runtime.wire.all_reduce, tag=self.name, async_op=runtime.overlap.all_reduce,
        )  # fmt: skip  # OAR: overlaps the dW GEMM below
        if not early_rs:
            dw = self._weight_grad(dy2, x2)
        handle.wait()
        return dx.to(x.dtype).view(x.shape), dw

    def _weight_grad(self, dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor | None:
        full = self.runtime.tuner.mm("dw", dy2.t(), x2).reshape(-1)
        deferred = self.runtime.overlap.reduce_scatter and self.comm.size("z") > 1
        shard, handle = self.comm.reduce_scatter(
            full, "z", tag=self.name, async_op=deferred, dtype=self.runtime.wire.reduce_scatter
        )
        if deferred:
            self.runtime.defer(self.weight, shard, handle)
            return None
        return shard.to(self.weight.dtype)


# ---------------------------------------------------------------------------------------
# Autograd-aware collectives for the layers around the Linears


def _gather_last_dim(t: torch.Tensor, comm: Comm, axis: str, tag: str) -> torch.Tensor:
    """The members' ``t`` side by side along the last dim: gathered along dim 0 as they
    lie, then put in place by one copy (not a transposed copy before and after)."""
    parts = comm.size(axis)
    if parts == 1:
        return t
    gathered, _ = comm.all_gather(t.contiguous(), axis, tag=tag)
    stacked = gathered.view(parts, *t.shape).movedim(0, -2)  # [..., parts, n]
    return stacked.reshape(*t.shape[:-1], parts * t.shape[-1])


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
        grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place
        ctx.comm.all_reduce(grad, "plane", tag="lm_head")
        return _slice_last_dim(grad, ctx.comm, "x"), None


class _GatherOverZ(torch.autograd.Function):
    """Flat z shard -> full block (all-gather); backward: reduce-scatter over z. Both
    travel in the wire dtype; the block is used, and its gradient summed locally, in the
    shard's dtype."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, comm: Comm, tag: str, wire: Wire):
        ctx.comm, ctx.tag, ctx.wire, ctx.dtype = comm, tag, wire, shard.dtype
        full, _ = comm.all_gather(shard.detach(), "z", tag=tag, dtype=wire.all_gather)
        return full.to(shard.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard, _ = ctx.comm.reduce_scatter(
            grad.contiguous().clone(), "z", tag=ctx.tag, dtype=ctx.wire.reduce_scatter
        )
        return shard.to(ctx.dtype), None, None, None


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


def _merged_statistics(
    xf: torch.Tensor, comm: Comm, tag: str, hidden: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(shift, offset, rstd)``: the mean over all h is ``shift + offset``.

    Each x member shifts its slice by its own rounded mean (``shift``), so that the
    centred values ``d`` carry no offset; their mean ``c`` (the rounding of ``shift``)
    and ``M2 = sum((d - c)^2)`` are exact. The members' (shift, c, M2) are all-gathered
    over x and merged as Chan et al. do for equal counts n: relative to member 0's
    shift, member r's mean is ``delta_r = (shift_r - shift_0) + c_r`` (a difference of
    nearby numbers, exact), the mean is ``mu = mean_r delta_r`` and
    ``M2 = sum_r M2_r + n sum_r (delta_r - mu)^2``. Every member merges the same
    gathered values, so all hold the same statistics. ``offset = (shift_0 - shift) + mu``
    is small, so ``(x - shift) - offset`` keeps fp32's relative precision at any offset.
    """
    shift = xf.mean(dim=-1, keepdim=True)
    d = xf - shift
    c = d.mean(dim=-1, keepdim=True)
    m2 = (d - c).square().sum(dim=-1, keepdim=True)
    stats = torch.stack([shift, c, m2])
    gathered, _ = comm.all_gather(stats, "x", tag=tag)
    shifts, cs, m2s = gathered.view(comm.size("x"), *stats.shape).unbind(1)
    delta = (shifts - shifts[0]) + cs
    mu = delta.mean(dim=0)
    var = (m2s.sum(dim=0) + xf.shape[-1] * (delta - mu).square().sum(dim=0)) / hidden
    return shift, (shifts[0] - shift) + mu, torch.rsqrt(var + eps)


class _LayerNormOverX(torch.autograd.Function):
    """LayerNorm of ``[..., h/x]`` slices over the full h (see ``_merged_statistics``).

    Saves the input and three numbers per token; the backward recomputes x_hat and
    needs ``sum(g)`` and ``sum(g * x_hat)`` over all h (g = dy * weight): one all-reduce
    of both over x.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                norm: TPLayerNorm):  # fmt: skip
        xf = x.float()
        shift, offset, rstd = _merged_statistics(xf, norm.comm, norm.name, norm.hidden, norm.eps)
        ctx.save_for_backward(x, weight, shift, offset, rstd)
        ctx.norm = norm
        return (((xf - shift) - offset) * rstd * weight + bias).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, shift, offset, rstd = ctx.saved_tensors
        norm = ctx.norm
        normed = ((x.float() - shift) - offset) * rstd
        g = dy.float()
        gw = g * weight
        sums = torch.stack([gw.sum(dim=-1), (gw * normed).sum(dim=-1)])
        norm.comm.all_reduce(sums, "x", tag=norm.name)
        mean_g, mean_gx = (sums / norm.hidden).unsqueeze(-1).unbind(0)
        dx = rstd * (gw - mean_g - normed * mean_gx)
        n = x.shape[-1]
        dweight = (g * normed).reshape(-1, n).sum(dim=0)
        dbias = g.reshape(-1, n).sum(dim=0)
        return dx.to(x.dtype), dweight.to(weight.dtype), dbias.to(weight.dtype), None


def _norm_parameter(
    hidden: int, comm: Comm, name: str, value: float, device: torch.device | str
) -> nn.Parameter:
    """A norm's weight or bias: its x slice of h, the same on every y and z rank."""
    local = _chunk_or_fail(hidden, comm.size("x"), f"{name} hidden")
    layout = ShardLayout(
        full_shape=(hidden,), splits=((0, "x"),), flatten_over_z=False,
        replicated_over=("y", "z"),
    )  # fmt: skip
    return set_layout(nn.Parameter(torch.full((local,), value, device=device)), layout)


class TPLayerNorm(nn.Module):
    """LayerNorm over h for activations holding h/x features; exact statistics over x."""

    def __init__(self, hidden: int, *, comm: Comm, name: str = "", eps: float = 1e-5,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        super().__init__()
        self.comm, self.name, self.hidden, self.eps = comm, name, hidden, eps
        self.weight = _norm_parameter(hidden, comm, name, 1.0, device)
        self.bias = _norm_parameter(hidden, comm, name, 0.0, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.size("x") == 1:
            return F.layer_norm(x, (self.hidden,), self.weight, self.bias, self.eps)
        return _LayerNormOverX.apply(x, self.weight, self.bias, self)


class _SumOverX(torch.autograd.Function):
    """Per-token partial sums of the x members, summed (all-reduce over x). Every member
    uses the sum for its own slice, so the gradient of a member's partial is the sum of
    all members' gradients: an all-reduce backward too."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, comm: Comm, tag: str):
        ctx.comm, ctx.tag = comm, tag
        total = partial.clone()
        comm.all_reduce(total, "x", tag=tag)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.comm.all_reduce(grad, "x", tag=ctx.tag)
        return grad, None, None


class TPRMSNorm(nn.Module):
    """RMSNorm over h for activations holding h/x features: the per-token sum of squares
    of the slices is summed over x (one all-reduce each way), computed in fp32 and cast
    back before the weight multiplies, as Hugging Face's LlamaRMSNorm does."""

    def __init__(self, hidden: int, *, comm: Comm, name: str = "", eps: float = 1e-5,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        super().__init__()
        self.comm, self.name, self.hidden, self.eps = comm, name, hidden, eps
        self.weight = _norm_parameter(hidden, comm, name, 1.0, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.square().sum(dim=-1, keepdim=True)
        if self.comm.size("x") > 1:
            squares = _SumOverX.apply(squares, self.comm, self.name)
        normed = xf * torch.rsqrt(squares / self.hidden + self.eps)
        return self.weight * normed.to(x.dtype)


class VocabParallelEmbedding(nn.Module):
    """Token + learned position embeddings, and the tied LM head with its loss.

    The token table (V x h) is padded with zero rows to a multiple of x*y; plane member
    p = x + G_x*y holds rows [p*V_l, (p+1)*V_l) with all h columns, flattened and split
    over z. The position table (S x h) is split by columns over x.
    """

    def __init__(self, vocab_size: int, max_seq_len: int, hidden: int, *, comm: Comm,
                 device: torch.device | str = "cpu", wire: Wire = FP32_WIRE,
                 positions: bool = True, tied: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.comm, self.vocab_size, self.hidden, self.wire = comm, vocab_size, hidden, wire
        plane = comm.size("plane")
        self.padded_vocab = -(-vocab_size // plane) * plane
        self.local_vocab = self.padded_vocab // plane
        self.vocab_start = comm.index("plane") * self.local_vocab
        shard = _chunk_or_fail(self.local_vocab * hidden, comm.size("z"), "token table block")
        self.wte = self._vocab_table(shard, device)
        # untied (Llama): an LM head of the token table's shape and layout
        self.lm_head = None if tied else self._vocab_table(shard, device)
        self.wpe = None
        if not positions:
            return
        local_hidden = _chunk_or_fail(hidden, comm.size("x"), "hidden")
        self.wpe = set_layout(
            nn.Parameter(torch.empty(max_seq_len, local_hidden, device=device)),
            ShardLayout(
                full_shape=(max_seq_len, hidden), splits=((1, "x"),), flatten_over_z=False,
                replicated_over=("y", "z"),
            ),
        )  # fmt: skip

    def _vocab_table(self, shard: int, device: torch.device | str) -> nn.Parameter:
        return set_layout(
            nn.Parameter(torch.empty(shard, device=device)),
            ShardLayout(
                full_shape=(self.vocab_size, self.hidden), splits=((0, "plane"),),
                flatten_over_z=True, replicated_over=(), pad_rows_to=self.padded_vocab,
            ),
        )  # fmt: skip

    def token_table(self) -> torch.Tensor:
        """This plane member's vocab rows ``[V_l, h]``, gathered over z (differentiable)."""
        return self._gathered(self.wte, "wte")

    def head_table(self, token_table: torch.Tensor) -> torch.Tensor:
        """The LM head's rows: the token table when tied, else the gathered ``lm_head``."""
        return token_table if self.lm_head is None else self._gathered(self.lm_head, "lm_head")

    def _gathered(self, shard: nn.Parameter, tag: str) -> torch.Tensor:
        if self.comm.size("z") == 1:
            return shard.view(self.local_vocab, self.hidden)
        block = _GatherOverZ.apply(shard, self.comm, tag, self.wire)
        return block.view(self.local_vocab, self.hidden)

    def embed(
        self, idx: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[b, s]`` token ids -> ``[b, s, h/x]`` hidden states; learned positions
        ``positions`` (``[b, s]``; None: 0..s-1)."""
        local = idx - self.vocab_start
        mine = (local >= 0) & (local < self.local_vocab)
        partial = F.embedding(local.clamp(0, self.local_vocab - 1), table)
        partial = partial * mine.unsqueeze(-1).to(partial.dtype)
        hidden = _PlaneSumToHidden.apply(partial, self.comm)
        if self.wpe is None:
            return hidden
        if positions is None:
            return hidden + self.wpe[: idx.shape[1]]
        return hidden + self.wpe[positions]

    def loss(
        self,
        hidden: torch.Tensor,
        table: torch.Tensor,
        targets: torch.Tensor,
        normalizer: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cross-entropy summed over the local labels that count (``targets`` other
        than ``IGNORE_INDEX``), divided by ``normalizer`` (None: their local number, the
        local mean). The same value on every plane member."""
        full = _HiddenToPlane.apply(hidden, self.comm)
        logits = full.reshape(-1, self.hidden) @ table.t()
        targets = targets.reshape(-1)
        counted = targets != IGNORE_INDEX
        per_token = _VocabParallelCrossEntropy.apply(
            logits, targets.clamp(min=0), self.comm, self.vocab_start, self.vocab_size
        )
        total = torch.where(counted, per_token, 0.0).sum()
        if normalizer is None:
            normalizer = counted.sum().clamp(min=1)
        return total / normalizer

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[..., V]`` of every position of ``hidden``."""
        full = _gather_last_dim(hidden, self.comm, "x", "lm_head")
        local = full.reshape(-1, self.hidden) @ table.t()  # [n, V_l]
        gathered, _ = self.comm.all_gather(local.t().contiguous(), "plane", tag="lm_head")
        out = gathered.t()[:, : self.vocab_size].contiguous()
        return out.view(*hidden.shape[:-1], self.vocab_size)

    @torch.no_grad()
    def last_logits(self, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[b, V]`` of the last position."""
        return self.logits(hidden[:, -1], table)
