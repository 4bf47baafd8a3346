"""Batched generation with a KV cache, on any grid; every rank takes part.

The grid's data × z planes split the prompts; each plane continues its share in batches
of similar lengths, and its first rank picks the tokens for all of its ranks. Sampling is
seeded per prompt, so the continuations are the same on every grid and batch size. The
end-of-run sample (``generate_one``) runs the same loop without a cache.

How planes stay in step, end of sequence and decoding: ``docs/job-side.md``
("train/inference/generation.py").
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Collection

import torch
import torch.distributed as dist
from torch import nn

from axonn_launch.common.models import ModelSpec
from axonn_launch.common.rules import prompt_length_problem
from axonn_launch.train.models.optim import autocast
from axonn_launch.train.parallel.attention import KVCache
from axonn_launch.train.parallel.groups import Groups

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
    rows = prompts or [[PAD]]
    if temperature > 0 and not generators:
        generators = [torch.Generator() for _ in rows]
    steps = CachedSteps(model, rows, max_new_tokens, device)
    pick = functools.partial(pick_tokens, temperature=temperature, top_k=top_k,
                             generators=generators)  # fmt: skip
    new = run_steps(model, steps, max_new_tokens, device=device, dtype=dtype, pick=pick,
                    eos_ids=eos_ids, idle=not prompts)  # fmt: skip
    return [until_eos(row, eos_ids) for row in new] if prompts else []


@torch.no_grad()
def generate_one(
    model: nn.Module,
    prompt: list[int],
    n_tokens: int,
    *,
    max_seq_len: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    temperature: float = 0.8,
    seed: int = 0,
    group=None,
    expect: Callable[[float], None] | None = None,
    eos_ids: Collection[int] = (),
) -> list[int]:
    """``prompt`` followed by ``n_tokens`` new tokens, or fewer when one of ``eos_ids``
    comes first (it ends the list); ``temperature=0`` is greedy. The end-of-run sample.

    Without a cache (``WindowSteps``), so it may run past ``max_seq_len``. Every rank runs
    the same row; rank 0's choice is broadcast over ``group`` (every rank; None: the
    default group). ``expect``: as in ``run_steps``."""
    generators = [torch.Generator(device="cpu").manual_seed(seed)]
    steps = WindowSteps(model, [prompt], max_seq_len, device, group)
    pick = functools.partial(pick_tokens, temperature=temperature, top_k=0, generators=generators)
    new = run_steps(model, steps, n_tokens, device=device, dtype=dtype, pick=pick,
                    eos_ids=eos_ids, expect=expect)  # fmt: skip
    return list(prompt) + until_eos(new[0], eos_ids)


class CachedSteps:
    """Next-token logits with a KV cache: the left-padded prompts run once, filling each
    layer's cache with this rank's heads, then each new token alone. The plane's first
    rank's tokens count; a row has ended once it has on every rank of the world."""

    def __init__(
        self, model: nn.Module, rows: list[list[int]], max_new_tokens: int, device: torch.device
    ) -> None:
        length = max(len(p) for p in rows)
        self.model, self.groups, self.device = model, model.groups, device
        self.pads = torch.tensor([length - len(p) for p in rows], device=device)
        self.idx = torch.tensor([[PAD] * (length - len(p)) + list(p) for p in rows], device=device)
        self.cache = KVCache(max_len=length + max_new_tokens)
        self.start, self.rows = 0, len(rows)

    def logits(self) -> torch.Tensor:
        return self.model.step_logits(self.idx, self.cache, self.start, self.pads)

    def share(self, choice: torch.Tensor) -> torch.Tensor:
        return broadcast_in_plane(choice, self.groups)

    def agree(self, ended: bool) -> bool:
        return all_ended(ended, self.groups, self.device)

    def extend(self, choice: torch.Tensor) -> None:
        self.start += self.idx.shape[1]
        self.idx = choice[:, None]


class WindowSteps:
    """Next-token logits of each row's last ``window`` tokens, computed again at every step
    (no cache, rows of one length): the context slides past the model's length. Rank 0's
    tokens count on every rank of ``group``, so every rank sees a row end at once."""

    def __init__(
        self, model: nn.Module, rows: list[list[int]], window: int, device: torch.device, group
    ) -> None:
        self.model, self.window, self.device, self.group = model, window, device, group
        self.tokens = [list(row) for row in rows]
        self.rows = len(rows)

    def logits(self) -> torch.Tensor:
        context = [row[-self.window :] for row in self.tokens]
        return self.model(torch.tensor(context, dtype=torch.long, device=self.device))

    def share(self, choice: torch.Tensor) -> torch.Tensor:
        return broadcast_from_rank0(choice, self.group)

    def agree(self, ended: bool) -> bool:
        return ended

    def extend(self, choice: torch.Tensor) -> None:
        for row, token in zip(self.tokens, choice.tolist(), strict=True):
            row.append(token)


@torch.no_grad()
def run_steps(
    model: nn.Module,
    steps: CachedSteps | WindowSteps,
    max_new_tokens: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    pick: Callable[[torch.Tensor], torch.Tensor],
    eos_ids: Collection[int] = (),
    idle: bool = False,
    expect: Callable[[float], None] | None = None,
) -> list[list[int]]:
    """The one decoding loop: up to ``max_new_tokens`` tokens per row of ``steps``, each
    ``pick``ed from the float logits and made common by ``steps.share``; it stops once
    every row has produced one of ``eos_ids`` (``idle``: filler rows, ended from the
    start). ``expect`` gets, once the first token is picked, the seconds the whole run
    will take at that pace (so that a long sample can say so before the console goes
    quiet). The model's mode is restored."""
    was_training = model.training
    model.eval()
    new: list[torch.Tensor] = []
    done = torch.full((steps.rows,), idle, dtype=torch.bool, device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device) if eos_ids else None
    began = time.perf_counter()
    for made in range(max_new_tokens):
        if made == 1 and expect is not None:
            expect((time.perf_counter() - began) * max_new_tokens)
        with autocast(device, dtype):
            logits = steps.logits()
        choice = steps.share(pick(logits.float()))
        new.append(choice)
        if eos is not None:
            done |= torch.isin(choice, eos)
            if steps.agree(bool(done.all())):
                break
        steps.extend(choice)
    model.train(was_training)
    return torch.stack(new, dim=1).tolist() if new else [[] for _ in range(steps.rows)]


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


# --------------------------------------------------------------------------- as text


def decode(tokens: list[int], data: str) -> str:
    """Text for the built-in byte-level corpus; token ids otherwise.

    Bytes a young model strings together are often not UTF-8, or are terminal control
    codes: both are shown escaped (``\\xe2``), so a log or a terminal shows only what the
    model wrote. A model whose vocabulary is larger than the bytes (``llama_tiny``: 512)
    may pick an id with no text: it shows as ``<id:300>``.
    """
    if data != "shakespeare":
        return " ".join(str(t) for t in tokens)
    text = byte_text(tokens, errors="backslashreplace")
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)


def byte_text(ids: list[int], errors: str = "replace") -> str:
    """``ids`` as UTF-8 bytes, each id outside 0..255 as ``<id:N>`` (a token of no text)."""
    parts, run = [], bytearray()
    for token in ids:
        if 0 <= token < 256:
            run.append(token)
            continue
        parts += [run.decode("utf-8", errors), f"<id:{token}>"]
        run = bytearray()
    return "".join([*parts, run.decode("utf-8", errors)])


def default_prompt(data: str) -> list[int]:
    return list(b"\n") if data == "shakespeare" else [0]
