"""Bytes per GPU for one (model, grid, batch) configuration.

A first-order model used on the login node to reject configurations that cannot fit
before they reach the queue. It follows what the training core (``axonn_launch.train``)
keeps on a GPU: fp32 parameters with bf16 autocast (train.dtype auto or bf16), or plain
fp32 (train.dtype fp32).

Notation: T = tokens per GPU per micro-step = micro_batch / z * seq_len, h = d_model,
f = d_ff, V = vocab, S = max_seq_len, l = layers.

* parameters, gradients, optimizer: the local shard (``local_param_elements``) times
  4 (fp32 weights) + 4 (fp32 grads) + 8 (two fp32 Adam moments). Linear weights and the
  token table are split over x*y and then flattened and split over z (axonn.md §2.3
  step 3); biases, LayerNorms and positions are split over x or y only.
* weight buffers: gathered fp32 blocks of the Linear in use and of the one prefetched
  (OAG), plus the bf16 copy the GEMM reads: (2*4 + 2) bytes times the largest block,
  4h^2/(x*y) elements (MLP). Nothing else is kept: the backward re-gathers.
* embedding buffers: the token table gathered over z, V/(x*y)*h elements, fp32 plus its
  bf16 copy for the LM head; alive for the whole micro-step.
* reduce-scatter buffers: the full fp32 dW block of a Linear before it is reduce-
  scattered over z, (4h^2 + 2hf)/(x*y) per layer. With ORS the collectives are waited
  for only at the next micro-step's forward (or in ``finish_gradients``), so every
  layer's blocks (and their 1/z results) stay alive; without ORS one Linear's at a time
  (the largest, h*f/(x*y)). Nothing when z == 1.
* activations: what each layer saves for its backward, counted tensor by tensor
  (``layer_activation_bytes``, checked against the training core's saved tensors).
  With full activation checkpointing (one layer per block) the stack keeps each
  layer's fp32 input (T*h/x*4) and, during the backward, one layer's full set.
* logits: bf16 logits, their fp32 copy, exponentials and softmax, and the fp32 gradient:
  T*V/(x*y)*(2 + 4 + 4 + 4 + 4) bytes.
* runtime reserve: CUDA/ROCm context, communicator buffers and allocator slack, a fixed
  RUNTIME_RESERVE_GIB.

The totals are compared with ``Hardware.mem_per_gpu_gb`` read as GiB (``fits``).
"""

from __future__ import annotations

from dataclasses import dataclass

from axonn_launch.grid import Grid
from axonn_launch.models import ModelSpec
from axonn_launch.rules import local_vocab
from axonn_launch.spec import TrainConfig

GIB = 1024**3
RUNTIME_RESERVE_GIB = 1.5  # context + NCCL/RCCL buffers + fragmentation, per GPU
BYTES_PER_PARAM_STATE = {"parameters": 4, "gradients": 4, "optimizer": 8}
LOGIT_BYTES = 2 + 4 + 4 + 4 + 4


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

    def fits(self, mem_per_gpu_gb: float) -> bool:
        """True when the estimate fits ``mem_per_gpu_gb`` (read as GiB; 0 = unbounded)."""
        return mem_per_gpu_gb <= 0 or self.total <= mem_per_gpu_gb * GIB


def estimate_memory(*, model: ModelSpec, grid: Grid, train: TrainConfig) -> MemoryEstimate:
    if train.micro_batch is None:
        raise ValueError("estimate_memory needs a micro_batch (rules.largest_fitting_micro_batch)")
    half = 4 if train.dtype == "fp32" else 2  # bytes of an autocast (bf16) tensor
    local = local_param_elements(model, grid)
    tokens = train.micro_batch / grid.z * train.seq_len
    terms = {name: local * nbytes for name, nbytes in BYTES_PER_PARAM_STATE.items()}
    terms["weight buffers"] = (2 * 4 + half) * model.d_model * model.d_ff / (grid.x * grid.y)
    terms["embedding buffers"] = local_vocab(model.vocab_size, grid) * model.d_model * (4 + half)
    terms["reduce-scatter buffers"] = _reduce_scatter_buffers(model, grid, train)
    terms["activations"] = _activations(model, grid, train, tokens, half)
    terms["logits"] = tokens * local_vocab(model.vocab_size, grid) * LOGIT_BYTES
    terms["runtime reserve"] = RUNTIME_RESERVE_GIB * GIB
    return MemoryEstimate(terms=terms)


def linear_weight_elements(model: ModelSpec) -> int:
    """Elements of one layer's four Linear weights: QKV 3h^2, projection h^2, MLP 2hf."""
    h, f = model.d_model, model.d_ff
    return 4 * h * h + 2 * h * f


def local_param_elements(model: ModelSpec, grid: Grid) -> float:
    """Parameter elements one rank holds (the training core's sharding, see above)."""
    h, x, y = model.d_model, grid.x, grid.y
    weights = linear_weight_elements(model) / (x * y * grid.z)
    table = local_vocab(model.vocab_size, grid) * h / grid.z  # vocab rows over x*y, then z
    return model.n_layer * weights + table + replicated_over_z_elements(model, grid)


def replicated_over_z_elements(model: ModelSpec, grid: Grid) -> float:
    """Biases, LayerNorms and positions: split over x or y, the same on every z rank.

    Per layer: QKV bias 3h/y, projection bias h/x, MLP biases f/y + h/x, two LayerNorms
    4h/x; plus the position table S*h/x and the final LayerNorm 2h/x.
    """
    h, f, x, y = model.d_model, model.d_ff, grid.x, grid.y
    per_layer = 3 * h / y + h / x + f / y + h / x + 4 * h / x
    return model.n_layer * per_layer + model.max_seq_len * h / x + 2 * h / x


def _reduce_scatter_buffers(model: ModelSpec, grid: Grid, train: TrainConfig) -> float:
    if grid.z == 1:
        return 0.0
    xy = grid.x * grid.y
    if train.overlap.reduce_scatter:
        return model.n_layer * linear_weight_elements(model) / xy * 4 * (1 + 1 / grid.z)
    return model.d_model * model.d_ff / xy * 4


def _activations(
    model: ModelSpec, grid: Grid, train: TrainConfig, tokens: float, half: int
) -> float:
    one_layer = layer_activation_bytes(model, grid, tokens, half)
    if train.activation_checkpointing:
        return model.n_layer * tokens * model.d_model / grid.x * 4 + one_layer
    return model.n_layer * one_layer


def layer_activation_bytes(model: ModelSpec, grid: Grid, tokens: float, half: int = 2) -> float:
    """Bytes one transformer layer saves for its backward in the training core.

    Sharded over x, fp32 (the residual stream is fp32 under autocast): the two LayerNorm
    inputs and the two LayerNorm outputs saved by QKV and MLP-up; with x > 1 the
    LayerNorm is computed by hand (statistics all-reduced over x) and keeps two more
    per norm (centred input and normalized output). Sharded over y: q, k, v and the
    attention output (autocast dtype), the GeLU input and output (fp32, f each); the
    fused attention kernel adds a log-sum-exp per head (fp32) instead of the s^2 score
    matrices that Korthikanti et al. (2022) count without one. Per token and LayerNorm:
    mean and inverse deviation (fp32), and the variance too when x > 1.
    """
    h, f = model.d_model, model.d_ff
    hidden_tensors = 8 if grid.x > 1 else 4
    hidden = tokens * h / grid.x * hidden_tensors * 4
    wide = tokens * (4 * h * half + 2 * f * 4) / grid.y
    lse = tokens * model.n_head / grid.y * 4
    norms = tokens * 2 * (3 if grid.x > 1 else 2) * 4
    return hidden + wide + lse + norms
