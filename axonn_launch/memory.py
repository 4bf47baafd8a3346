"""Bytes per GPU for one (model, grid, batch) configuration.

A first-order model used on the login node to reject configurations that cannot fit
before they reach the queue. It assumes mixed precision as the training core runs it
on GPUs (train.dtype auto or bf16): fp32 master weights, fp32 gradients and two fp32
Adam moments per parameter shard, bf16 activations and weight/gradient communication
buffers. With train.dtype=fp32 activations and buffers take 4 bytes per element.

Terms (per GPU; T = tokens per GPU per micro-step = micro_batch / z * seq_len,
h = d_model, f = d_ff, V = vocab, l = layers, P = n_params, e = activation bytes):

* parameters, gradients, optimizer: P / (x*y*z) * (4 + 4 + 8). Every weight is sharded
  over x*y (2D) and then flattened and split over z (axonn.md §2.3 step 3).
* weight buffers: all-gathered bf16 blocks of (4h^2 + 2hf)/(x*y) elements per layer
  (QKV 3h^2, projection h^2, MLP 2hf). Without activation checkpointing autograd keeps every layer's gathered block
  for its dX GEMM (l blocks); with checkpointing only the layer being recomputed and the
  prefetched one (2 blocks).
* reduce-scatter buffers: the full dW block of a layer before it is reduce-scattered over
  z. With ORS the collectives are waited for at the end of the backward, so all l blocks
  stay alive; without it one block at a time. None when z == 1.
* activations: saved-for-backward tensors of Korthikanti et al. 2022 (eq. 2, "no
  parallelism": 34*s*b*h bytes plus the s^2 attention terms), split as our layout splits
  them: hidden-sized tensors (LayerNorm inputs, QKV and MLP inputs: 4 tensors, plus the
  two 1-byte dropout masks) are sharded over x; QKV outputs, attention output and the
  two 4h MLP tensors (12 tensors of h) over y. Attention runs as a fused (flash) kernel,
  which keeps only the output and the log-sum-exp (4 bytes per head per token) instead
  of the a*s^2 score matrices.
  With full activation checkpointing (one layer per block) the stack keeps each layer's
  input (T*h/x) and, during the backward, one layer's full set.
* logits: fp32 logits and their gradient for the vocab-parallel loss, T*V/(x*y)*4*2.
* runtime reserve: CUDA/ROCm context, communicator buffers and allocator slack, a fixed
  RUNTIME_RESERVE_GIB.
"""

from __future__ import annotations

from dataclasses import dataclass

from axonn_launch.grid import Grid
from axonn_launch.models import ModelSpec
from axonn_launch.spec import TrainConfig

GIB = 1024**3
RUNTIME_RESERVE_GIB = 1.5  # context + NCCL/RCCL buffers + fragmentation, per GPU
BYTES_PER_PARAM_STATE = {"parameters": 4, "gradients": 4, "optimizer": 8}


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
        """True when the estimate fits ``mem_per_gpu_gb`` (GiB; 0 means unbounded)."""
        return mem_per_gpu_gb <= 0 or self.total <= mem_per_gpu_gb * GIB


def estimate_memory(*, model: ModelSpec, grid: Grid, train: TrainConfig) -> MemoryEstimate:
    e = 4 if train.dtype == "fp32" else 2
    shard = model.n_params() / grid.tensor_parallel
    tokens = train.micro_batch / grid.z * train.seq_len
    terms = {name: shard * nbytes for name, nbytes in BYTES_PER_PARAM_STATE.items()}
    terms["weight buffers"] = _weight_buffers(model, grid, train, e)
    terms["reduce-scatter buffers"] = _reduce_scatter_buffers(model, grid, train, e)
    terms["activations"] = _activations(model, grid, train, tokens, e)
    terms["logits"] = tokens * model.vocab_size / (grid.x * grid.y) * 4 * 2
    terms["runtime reserve"] = RUNTIME_RESERVE_GIB * GIB
    return MemoryEstimate(terms=terms)


def layer_block_elements(model: ModelSpec, grid: Grid) -> float:
    """Elements of one layer's four weight blocks after the 2D (x*y) split: (4h^2 + 2hf)/(x*y)."""
    h, f = model.d_model, model.d_ff
    return (4 * h * h + 2 * h * f) / (grid.x * grid.y)


def _weight_buffers(model: ModelSpec, grid: Grid, train: TrainConfig, e: int) -> float:
    layers = 2 if train.activation_checkpointing else model.n_layer
    return min(layers, model.n_layer) * layer_block_elements(model, grid) * e


def _reduce_scatter_buffers(model: ModelSpec, grid: Grid, train: TrainConfig, e: int) -> float:
    if grid.z == 1:
        return 0.0
    layers = model.n_layer if train.overlap.reduce_scatter else 1
    return layers * layer_block_elements(model, grid) * e


def _activations(
    model: ModelSpec, grid: Grid, train: TrainConfig, tokens: float, e: int
) -> float:
    one_layer = layer_activation_bytes(model, grid, tokens, e)
    if train.activation_checkpointing:
        return model.n_layer * tokens * model.d_model / grid.x * e + one_layer
    return model.n_layer * one_layer


def layer_activation_bytes(model: ModelSpec, grid: Grid, tokens: float, e: int = 2) -> float:
    """Bytes one layer saves for its backward (Korthikanti et al. 2022, eq. 2, with a
    fused attention kernel), sharded as described in the module docstring."""
    h = model.d_model
    hidden = tokens * h / grid.x * (4 * e + 2)  # 4 hidden-sized tensors + 2 one-byte masks
    wide = tokens * h / grid.y * 12 * e  # q, k, v, attention output, 4h GeLU in, 4h GeLU out
    lse = tokens * model.n_head / grid.y * 4  # fp32 log-sum-exp per head per token
    return hidden + wide + lse
