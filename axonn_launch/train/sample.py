"""Text generation with the parallel model; every rank takes part, rank 0 prints.

All ranks run the same forward on the same context (the model returns full-vocab
logits of the last position on every rank). Rank 0 picks each token and broadcasts it,
so all ranks extend the context identically even if their logits differ in the last bit.
"""

from __future__ import annotations

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
) -> list[int]:
    """``prompt`` followed by ``n_tokens`` new tokens; ``temperature=0`` is greedy.

    Rank 0's choice is broadcast over ``group`` (every rank; None: the default group)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tokens = list(prompt)
    was_training = model.training
    model.eval()
    for _ in range(n_tokens):
        context = torch.tensor([tokens[-max_seq_len:]], dtype=torch.long, device=device)
        with autocast(device, dtype):
            logits = model(context)
        choice = pick_tokens(logits.float(), temperature, 0, [generator])
        tokens.append(int(broadcast_from_rank0(choice, group).item()))
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
