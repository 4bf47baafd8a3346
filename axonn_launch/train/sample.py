"""Text generation with the parallel model; every rank takes part, rank 0 prints.

All ranks run the same forward on the same context (the model returns full-vocab
logits of the last position on every rank). Rank 0 picks each token and broadcasts it,
so all ranks extend the context identically even if their logits differ in the last bit.
It stops after the first of ``eos_ids`` (as ``generation.generate`` and transformers do);
a model trained on the built-in byte corpus has no end-of-sequence id, so its sample
always runs the tokens asked for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import torch
from torch import nn

from axonn_launch.train.generation import broadcast_from_rank0, pick_tokens
from axonn_launch.train.loop import autocast


@torch.no_grad()
def generate(
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
    comes first (it ends the list); ``temperature=0`` is greedy.

    Rank 0's choice is broadcast over ``group`` (every rank; None: the default group).
    ``expect`` gets, once the first token is picked, the seconds the whole sample will take
    at that pace (so that a long sample can say so before the console goes quiet)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tokens = list(prompt)
    was_training = model.training
    model.eval()
    began = time.perf_counter()
    for made in range(n_tokens):
        if made == 1 and expect is not None:
            expect((time.perf_counter() - began) * n_tokens)
        context = torch.tensor([tokens[-max_seq_len:]], dtype=torch.long, device=device)
        with autocast(device, dtype):
            logits = model(context)
        choice = pick_tokens(logits.float(), temperature, 0, [generator])
        tokens.append(int(broadcast_from_rank0(choice, group).item()))
        if tokens[-1] in eos_ids:
            break
    model.train(was_training)
    return tokens


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
