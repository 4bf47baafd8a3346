"""Bytes per GPU for one (model, grid, batch) configuration.

A first-order model used on the login node to reject configurations that cannot
fit before they reach the queue. Mixed precision as the training core runs it on
GPUs: fp32 master weights, fp32 gradients and two fp32 Adam moments per parameter
shard (16 bytes per sharded parameter), bf16 weight all-gather buffers for the
layer in use and the one prefetched, and activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from axonn_launch.grid import Grid
from axonn_launch.models import ModelSpec
from axonn_launch.spec import TrainConfig

GIB = 1024**3


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


def estimate_memory(*, model: ModelSpec, grid: Grid, train: TrainConfig) -> MemoryEstimate:
    h, l, s = model.d_model, model.n_layer, train.seq_len
    shard = model.n_params() / grid.tensor_parallel
    layer_weights = 12 * h * h / (grid.x * grid.y)  # one layer's gathered weight block
    tokens = train.micro_batch // grid.z * s  # tokens per GPU per micro-step
    if train.activation_checkpointing:
        # layer inputs kept for every layer + one layer's activations during recompute
        acts = l * tokens * h / grid.x * 2 + _layer_activations(model, grid, tokens, s)
    else:
        acts = l * _layer_activations(model, grid, tokens, s)
    logits = tokens * model.vocab_size / (grid.x * grid.y) * 4 * 2
    return MemoryEstimate(
        terms={
            "parameters": shard * 4,
            "gradients": shard * 4,
            "optimizer": shard * 8,
            "weight buffers": 2 * layer_weights * 2,
            "activations": acts,
            "logits": logits,
        }
    )


def _layer_activations(model: ModelSpec, grid: Grid, tokens: int, seq_len: int) -> float:
    """bf16 activations saved for backward by one layer (Korthikanti et al. 2022, eq. 2),
    with hidden-sized tensors split over x, 4h-sized and attention tensors over y."""
    h, a = model.d_model, model.n_head
    hidden = tokens * h * 2 * 10 / grid.x  # norms, residuals, qkv/attn-out inputs
    wide = tokens * h * 2 * 24 / grid.y  # qkv outputs, 4h MLP activations
    scores = tokens * seq_len * a * 2 * 2.5 / grid.y  # attention scores, softmax, dropout mask
    return hidden + wide + scores
