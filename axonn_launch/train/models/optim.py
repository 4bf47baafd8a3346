"""What a model trains and runs with: AdamW (``adamw.py``) over its parameters (weight
decay on matrices only) and the dtype it computes in (bf16 autocast over fp32 master
weights, or fp32).

The training loop, the generation loops and export (which rebuilds the optimizer to read
its moments) all take them from here.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from axonn_launch.common.spec import TrainConfig
from axonn_launch.train.models.adamw import AdamW


def is_matrix(param: nn.Parameter) -> bool:
    """Weight decay applies to matrices (Linear weights, embeddings), not biases or norms.

    Sharded weights are stored flattened, so the full tensor's shape is read from the
    parameter's ``shard_layout`` (set by the parallel layers) when it has one.
    """
    layout = getattr(param, "shard_layout", None)
    shape = layout.full_shape if layout is not None else param.shape
    return len(shape) >= 2


def build_optimizer(model: nn.Module, train: TrainConfig) -> AdamW:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if is_matrix(param) else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=1e-8)


def compute_dtype(train: TrainConfig, device: torch.device) -> torch.dtype:
    if train.dtype not in ("auto", "fp32", "bf16"):
        raise ValueError(f"train.dtype={train.dtype!r}: use auto, fp32 or bf16")
    return torch.bfloat16 if train.computes_in_bf16(device.type == "cuda") else torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """bf16 autocast (fp32 master weights and optimizer); fp32 runs without autocast."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
