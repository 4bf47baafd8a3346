"""Batched generation with a KV cache, on any grid; every rank takes part.

Prompts of one batch are left-padded to one length; the prompt runs once through the
model (filling each layer's cache with this rank's heads), then each new token runs
alone. Every rank computes the same full-vocabulary logits; rank 0 picks the tokens and
broadcasts them, so all ranks extend the batch identically even where their logits
differ in the last bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from axonn_launch.train.attention import KVCache
from axonn_launch.train.loop import autocast

PAD = 0  # the id left-padding uses: masked out of attention, never seen by the model


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    group=None,
) -> list[list[int]]:
    """The new tokens of each prompt (greedy when ``temperature`` is 0; else sampled at
    that temperature from the ``top_k`` most likely, 0 = all). A row that produced
    ``eos_id`` ends with it. ``group`` holds every rank (None: the default group)."""
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    length = max(len(p) for p in prompts)
    limit = model.spec.max_seq_len
    if length + max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {length} tokens plus max_new_tokens={max_new_tokens} exceeds "
            f"the model's max_seq_len={limit}"
        )
    pads = torch.tensor([length - len(p) for p in prompts], device=device)
    idx = torch.tensor([[PAD] * (length - len(p)) + list(p) for p in prompts], device=device)
    cache = KVCache(max_len=length + max_new_tokens)
    was_training = model.training
    model.eval()
    new: list[torch.Tensor] = []
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    start = 0
    for _ in range(max_new_tokens):
        with autocast(device, dtype):
            logits = model.step_logits(idx, cache, start, pads)
        choice = broadcast_from_rank0(
            pick_tokens(logits.float(), temperature, top_k, generator), group
        )
        new.append(choice)
        if eos_id is not None:
            done |= choice == eos_id
            if bool(done.all()):
                break
        start += idx.shape[1]
        idx = choice[:, None]
    model.train(was_training)
    return [_until_eos(row, eos_id) for row in torch.stack(new, dim=1).tolist()]


def pick_tokens(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of ``[b, V]`` logits (argmax when ``temperature`` <= 0)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scaled = logits / temperature
    if 0 < top_k < scaled.shape[-1]:
        floor = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    probs = scaled.softmax(dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(logits.device)


def broadcast_from_rank0(tokens: torch.Tensor, group) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tokens, src=0, group=group)
    return tokens


def _until_eos(row: list[int], eos_id: int | None) -> list[int]:
    if eos_id is not None and eos_id in row:
        return row[: row.index(eos_id) + 1]
    return row
