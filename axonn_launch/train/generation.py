"""Batched generation with a KV cache, on any grid; every rank takes part.

The grid's data × z planes split the prompts: sorted by length and dealt out in turn, so
each x*y plane continues its share, in batches of similar lengths. A batch is left-padded
to one length; the prompt runs once through the model (filling each layer's cache with
this rank's heads), then each new token runs alone. Every rank of a plane computes the
same full-vocabulary logits; the plane's first rank picks the tokens and broadcasts them
within the plane, so its ranks extend the batch identically even where their logits
differ in the last bit. The z ranks of a forward all-gather weights together, so every
plane runs the same number of batches and steps: a plane out of prompts runs a one-token
filler row, and a batch stops at end-of-sequence only once the rows of every plane have
ended. Then every rank gathers all continuations.

End of sequence, as transformers' ``generate``: a row ends with the first of ``eos_ids``
it produces (a Llama 3 config lists several), greedy or sampled, and nothing follows it;
the other rows of its batch run on.

Sampling draws each prompt's tokens from a generator of its own, seeded by (seed, the
prompt's number): the same continuations on every grid and for every batch size.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn

from axonn_launch.common.models import ModelSpec
from axonn_launch.common.rules import prompt_length_problem
from axonn_launch.train.attention import KVCache
from axonn_launch.train.groups import Groups
from axonn_launch.train.loop import autocast

PAD = 0  # the id left-padding uses: masked out of attention, never seen by the model


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    batch_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_ids: Collection[int] = (),
    seed: int = 0,
) -> list[list[int]]:
    """The new tokens of each prompt, on every rank (greedy when ``temperature`` is 0;
    else sampled at that temperature from the ``top_k`` most likely, 0 = all). A row that
    produced one of ``eos_ids`` ends with it."""
    check_lengths(prompts, max_new_tokens, model.spec)
    groups: Groups = model.groups
    planes = groups.size("data") * groups.size("z")
    plane = groups.index("data") * groups.size("z") + groups.index("z")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    mine = order[plane::planes]
    rounds = math.ceil(math.ceil(len(prompts) / planes) / batch_size)
    outputs: dict[int, list[int]] = {}
    for r in range(rounds):
        batch = mine[r * batch_size : (r + 1) * batch_size]
        generators = [prompt_generator(seed, i) for i in batch] if temperature > 0 else None
        new = generate_batch(
            model, [prompts[i] for i in batch], max_new_tokens, device=device, dtype=dtype,
            temperature=temperature, top_k=top_k, eos_ids=eos_ids, generators=generators,
        )  # fmt: skip
        outputs.update(zip(batch, new))
    return [tokens for _, tokens in sorted(gather(outputs, groups).items())]


def check_lengths(prompts: list[list[int]], max_new_tokens: int, spec: ModelSpec) -> None:
    """The login node's rule (``rules.prompt_length_problem``), for each batch."""
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    length = max((len(p) for p in prompts), default=0)
    problem = prompt_length_problem("a prompt", length, "max_new_tokens", max_new_tokens, spec)
    if problem:
        raise ValueError(problem)


def prompt_generator(seed: int, number: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + number) % 2**63)


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
    eos_ids: Collection[int] = (),
    generators: list[torch.Generator] | None = None,
) -> list[list[int]]:
    """One batch of this plane: the new tokens of each prompt (``generate``'s rules;
    ``generators``: one per prompt when sampling). Every rank of the world calls it at
    once; no prompts: a filler row that runs along."""
    check_lengths(prompts, max_new_tokens, model.spec)
    groups: Groups = model.groups
    rows = prompts or [[PAD]]
    if temperature > 0 and not generators:
        generators = [torch.Generator() for _ in rows]
    length = max(len(p) for p in rows)
    pads = torch.tensor([length - len(p) for p in rows], device=device)
    idx = torch.tensor([[PAD] * (length - len(p)) + list(p) for p in rows], device=device)
    cache = KVCache(max_len=length + max_new_tokens)
    was_training = model.training
    model.eval()
    new: list[torch.Tensor] = []
    done = torch.full((len(rows),), not prompts, dtype=torch.bool, device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device) if eos_ids else None
    start = 0
    for _ in range(max_new_tokens):
        with autocast(device, dtype):
            logits = model.step_logits(idx, cache, start, pads)
        choice = pick_tokens(logits.float(), temperature, top_k, generators)
        choice = broadcast_in_plane(choice, groups)
        new.append(choice)
        if eos is not None:
            done |= torch.isin(choice, eos)
            if all_ended(bool(done.all()), groups, device):
                break
        start += idx.shape[1]
        idx = choice[:, None]
    model.train(was_training)
    if not prompts:
        return []
    return [until_eos(row, eos_ids) for row in torch.stack(new, dim=1).tolist()]


def pick_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    generators: list[torch.Generator] | None,
) -> torch.Tensor:
    """One token per row of ``[b, V]`` logits (argmax when ``temperature`` <= 0; else
    row r draws with ``generators[r]``)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scaled = logits / temperature
    if 0 < top_k < scaled.shape[-1]:
        floor = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    probs = scaled.softmax(dim=-1).cpu()
    picks = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators or [])]
    return torch.cat(picks).to(logits.device)


def broadcast_from_rank0(tokens: torch.Tensor, group) -> torch.Tensor:
    """Rank 0's ``tokens`` on every rank of ``group`` (every rank; None: the default)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tokens, src=0, group=group)
    return tokens


def broadcast_in_plane(tokens: torch.Tensor, groups: Groups) -> torch.Tensor:
    """The plane's first rank's ``tokens`` on every rank of the plane."""
    if groups.plane is not None:
        dist.broadcast(tokens, src=dist.get_global_rank(groups.plane, 0), group=groups.plane)
    return tokens


def all_ended(ended: bool, groups: Groups, device: torch.device) -> bool:
    """Whether ``ended`` holds on every rank of the world."""
    if groups.world is None:
        return ended
    flag = torch.tensor([int(ended)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=groups.world)
    return bool(flag.item())


def gather(outputs: dict[int, list[int]], groups: Groups) -> dict[int, list[int]]:
    """Every plane's continuations, on every rank."""
    if groups.world is None:
        return outputs
    parts: list[dict[int, list[int]] | None] = [None] * dist.get_world_size(groups.world)
    dist.all_gather_object(parts, outputs, group=groups.world)
    return {i: tokens for part in parts for i, tokens in (part or {}).items()}


def until_eos(row: list[int], eos_ids: Collection[int]) -> list[int]:
    """``row`` up to and with its first end-of-sequence id (what transformers returns)."""
    ends = [i for i, token in enumerate(row) if token in eos_ids]
    return row[: ends[0] + 1] if ends else row
