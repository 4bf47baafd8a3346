"""Bytes per GPU for one (model, grid, batch) configuration.

A first-order model used on the login node to reject configurations that cannot fit
before they reach the queue. It follows what the training core keeps on a GPU, part by
part (parameters, gradients, optimizer, weight buffers and cache, embedding and
reduce-scatter buffers, activations, logits, a runtime reserve); ``fits`` compares the
total with ``Hardware.mem_per_gpu_gb`` read as GiB.

Each part's formula and notation: ``docs/cost-model.md`` ("cost/memory.py").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from axonn_launch.common import rules
from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import Hardware
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.rules import local_vocab
from axonn_launch.common.spec import TrainConfig
from axonn_launch.common.traffic import (
    WireBytes,
    largest_linear_block,
    linear_weight_elements,
    wire_bytes,
)

GIB = 1024**3
RUNTIME_RESERVE_GIB = 1.5  # context + NCCL/RCCL buffers + fragmentation, per GPU
CPU_RUNTIME_RESERVE_GIB = 0.5  # interpreter + torch + gloo, per CPU rank (machine=local)
BYTES_PER_PARAM_STATE = {"parameters": 4, "gradients": 4, "optimizer": 8}
LOGIT_BYTES = 2 + 4 + 4 + 4 + 4
TOKEN_TERMS = ("activations", "head input", "logits")  # linear in T; no other term is


@dataclass(frozen=True)
class MemoryEstimate:
    terms: dict[str, float]  # bytes per GPU, by term

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def biggest(self) -> tuple[str, float]:
        return max(self.terms.items(), key=lambda kv: kv[1])

    def describe(self) -> str:
        name, value = self.biggest()
        return f"{self.total / GIB:.1f} GiB per GPU (largest term: {name} {value / GIB:.1f} GiB)"

    def at_micro_batch(self, ratio: float) -> MemoryEstimate:
        """The estimate with the micro-batch scaled by ``ratio``: only the terms in
        ``TOKEN_TERMS`` grow with the tokens per micro-step, each linearly."""
        terms = {k: v * ratio if k in TOKEN_TERMS else v for k, v in self.terms.items()}
        return MemoryEstimate(terms=terms)

    def fits(self, mem_per_gpu_gb: float) -> bool:
        """True when the estimate fits ``mem_per_gpu_gb`` (read as GiB; 0 = unbounded)."""
        return mem_per_gpu_gb <= 0 or self.total <= mem_per_gpu_gb * GIB


@functools.lru_cache(maxsize=65536)
def estimate_memory(
    *, model: ModelSpec, grid: Grid, train: TrainConfig, on_gpu: bool = True
) -> MemoryEstimate:
    """Bytes per GPU by term (module docstring); ``on_gpu`` resolves the ``auto`` dtypes.

    Computed once per distinct input in a process: the validation, the planner's ranking
    and the summary ask for the same grids (its inputs are frozen; callers do not change
    the returned terms)."""
    if train.micro_batch is None:
        raise ValueError("estimate_memory needs a micro_batch (fit_micro_batch chooses one)")
    wire = wire_bytes(train, on_gpu=on_gpu)
    half = wire.compute
    local = local_param_elements(model, grid)
    tokens = train.micro_batch / grid.z * train.seq_len
    vocab_rows = local_vocab(model.vocab_size, grid)
    terms = {name: local * nbytes for name, nbytes in BYTES_PER_PARAM_STATE.items()}
    block = largest_linear_block(model, grid)
    terms["weight buffers"] = (2 * wire.all_gather + _cast_copy(wire)) * block
    kept = cached_blocks(model, grid, train) + recompute_kept_blocks(model, grid, train)
    terms["weight cache"] = kept * cache_bytes_per_block(model, grid, wire)
    table = model.vocab_tables * vocab_rows * model.d_model
    terms["embedding buffers"] = table * (wire.all_gather + _cast_copy(wire))
    terms["reduce-scatter buffers"] = reduce_scatter_buffers(model, grid, train, wire)
    terms["activations"] = _activations(model, grid, train, tokens, half)
    # the LM head's input: the final hidden gathered over x to all of d_model, kept in the
    # compute dtype for its backward (measured: rehearse=rank, docs/cost-model.md)
    terms["head input"] = tokens * model.d_model * half
    terms["logits"] = tokens * vocab_rows * LOGIT_BYTES
    terms["runtime reserve"] = (RUNTIME_RESERVE_GIB if on_gpu else CPU_RUNTIME_RESERVE_GIB) * GIB
    return MemoryEstimate(terms=terms)


def _cast_copy(wire: WireBytes) -> int:
    """Bytes per element of autocast's copy of a gathered weight (none if it is already
    in the compute dtype)."""
    return wire.compute if wire.all_gather != wire.compute else 0


def cached_blocks(model: ModelSpec, grid: Grid, train: TrainConfig) -> int:
    """Blocks whose gathered weights are kept (none when z == 1: nothing is gathered)."""
    return 0 if grid.z == 1 else min(train.cache_layers or 0, model.n_layer)


def recompute_kept_blocks(model: ModelSpec, grid: Grid, train: TrainConfig) -> int:
    """1 when an uncached block's recompute keeps its gathered weights for its backward."""
    uncached = cached_blocks(model, grid, train) < model.n_layer
    return int(grid.z > 1 and train.activation_checkpointing and uncached)


def cache_bytes_per_block(model: ModelSpec, grid: Grid, wire: WireBytes) -> float:
    """One cached block's gathered weights: its Linear blocks at the gather dtype."""
    return linear_weight_elements(model, grid) * wire.all_gather


def largest_cache_that_fits(
    model: ModelSpec, grid: Grid, train: TrainConfig, mem_per_gpu_gb: float, *, on_gpu: bool = True
) -> int:
    """The most blocks (<= n_layer) whose weights can be cached on top of ``train``'s
    estimate without its cache (its micro-batch as given) and still fit
    ``mem_per_gpu_gb`` (GiB; 0 = unbounded: every block). 0 when z == 1, or when even the
    uncached estimate does not fit. The cache is the only term that grows with N."""
    if grid.z == 1:
        return 0
    uncached = replace(train, cache_layers=0)
    base = estimate_memory(model=model, grid=grid, train=uncached, on_gpu=on_gpu)
    if mem_per_gpu_gb <= 0:
        return model.n_layer
    per_block = cache_bytes_per_block(model, grid, wire_bytes(train, on_gpu=on_gpu))
    room = mem_per_gpu_gb * GIB - base.total
    return max(0, min(model.n_layer, int(room // per_block)))


def local_param_elements(model: ModelSpec, grid: Grid) -> float:
    """Parameter elements one rank holds (the training core's sharding, see above)."""
    weights = linear_weight_elements(model, grid) / grid.z
    rows = local_vocab(model.vocab_size, grid)  # vocab rows over x*y, then z
    tables = model.vocab_tables * rows * model.d_model / grid.z
    return model.n_layer * weights + tables + replicated_over_z_elements(model, grid)


def replicated_over_z_elements(model: ModelSpec, grid: Grid) -> float:
    """Biases, norms and positions (the architecture's small parameters): split over x
    or y, the same on every z rank."""
    arch = model.architecture
    total = model.n_layer * sum(p.local_elements(grid) for p in arch.layer_small_params(model))
    for param in arch.model_small_params(model):
        total += param.local_elements(grid)
    return total


def reduce_scatter_buffers(
    model: ModelSpec, grid: Grid, train: TrainConfig, wire: WireBytes
) -> float:
    """Bytes of the weight-gradient blocks alive before and after their reduce-scatter."""
    if grid.z == 1:
        return 0.0
    per_element = wire.reduce_scatter * (1 + 1 / grid.z)  # the full block and its shard
    if not train.overlap.reduce_scatter:
        return largest_linear_block(model, grid) * per_element
    return pending_blocks(model, train) * linear_weight_elements(model, grid) * per_element


def pending_blocks(model: ModelSpec, train: TrainConfig) -> int:
    """Blocks whose reduce-scatters ORS may have in flight: the window, or every block."""
    window = train.ors_window
    return model.n_layer if window <= 0 else min(window, model.n_layer)


def _activations(
    model: ModelSpec, grid: Grid, train: TrainConfig, tokens: float, half: int
) -> float:
    one_layer = layer_activation_bytes(model, grid, tokens, half)
    if train.activation_checkpointing:
        return model.n_layer * tokens * model.d_model / grid.x * 4 + one_layer
    return model.n_layer * one_layer


def layer_activation_bytes(model: ModelSpec, grid: Grid, tokens: float, half: int = 2) -> float:
    """Bytes one transformer layer saves for its backward in the training core, tensor by
    tensor (``Architecture.layer_activation_bytes``)."""
    return model.architecture.layer_activation_bytes(model, grid, tokens, half)


def fit_micro_batch(
    model: ModelSpec, grid: Grid, train: TrainConfig, hardware: Hardware
) -> tuple[int, MemoryEstimate] | str:
    """The micro-batch to run and its memory estimate (``estimate_memory``), or why none can.

    A given ``train.micro_batch`` must be valid and fit. None (automatic) takes the
    largest valid one that fits: it gives the fewest micro-steps, hence the fewest weight
    all-gathers and reduce-scatters over z, which repeat per micro-step.
    """
    why = rules.batch_problem(train, grid)
    if why:
        return why
    if train.micro_batch is None:
        candidates = rules.micro_batch_candidates(train, grid)
    else:
        candidates = [train.micro_batch]
    first = replace(train, micro_batch=candidates[0])
    largest = estimate_memory(model=model, grid=grid, train=first, on_gpu=hardware.runs_on_gpu)
    for micro in candidates:  # one estimate per grid: the others scale its token terms
        estimate = largest.at_micro_batch(micro / candidates[0])
        if estimate.fits(hardware.mem_per_gpu_gb):
            return micro, estimate
    gib = 1024**3
    name, value = estimate.biggest()
    return (
        f"grid ({grid.describe()}) with train.micro_batch={micro}: needs"
        f" {estimate.total / gib:.1f} GiB per GPU but {rules.with_article(hardware.gpu_model)} has"
        f" {hardware.mem_per_gpu_gb:g} GiB (largest term: {name} {value / gib:.1f} GiB); use"
        f" {rules.or_list(memory_remedies(train, grid))}"
    )


def memory_remedies(train: TrainConfig, grid: Grid) -> list[str]:
    """What would lower the memory per GPU, leaving out what is already set: a smaller
    micro-batch only when one was pinned (the automatic choice tried every valid one)."""
    remedies = ["more z/x/y ranks"]
    smaller = [m for m in rules.micro_batch_candidates(train, grid) if m < (train.micro_batch or 0)]
    if train.micro_batch is not None and smaller:
        remedies.append(f"a smaller train.micro_batch (valid: {rules.listed(smaller)})")
    if train.cache_layers:
        remedies.append("fewer cached blocks (train.cache_layers=0)")
    if not train.activation_checkpointing:
        remedies.append("train.activation_checkpointing=true")
    return remedies
