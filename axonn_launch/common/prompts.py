"""A generation job's prompts, their token counts and its end-of-sequence ids, without torch.

The login node (``config/resolve.py``, ``submit/summary.py``) and the job
(``train/inference/generate_job.py``) ask these functions, so that the login node refuses
exactly the prompts the job would, and names the end-of-sequence ids the job stops at.

Which tokenizer and which end-of-sequence ids, and when text is not counted here:
``docs/job-side.md`` ("common/prompts.py").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from axonn_launch.common.models import ModelSpec
from axonn_launch.common.rules import prompt_length_problem
from axonn_launch.common.spec import GenerateConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
EOS_FILES = ("generation_config.json", "config.json")  # transformers' order


def has_byte_vocab(data: str, init_from: str, checkpoint: str) -> bool:
    """The model's ids are bytes: trained on the built-in byte-level corpus, and not the
    weights of a Hugging Face directory (its ids are its own tokenizer's)."""
    hf_weights = bool(init_from) and not checkpoint
    return data == "shakespeare" and not hf_weights


def has_tokenizer(directory: str) -> bool:
    return bool(directory) and any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_path(tokenizer: str, init_from: str) -> str:
    """``generate.tokenizer``, else ``model.init_from`` when it holds a tokenizer; ""."""
    return tokenizer or (init_from if has_tokenizer(init_from) else "")


def config_eos_ids(directory: str) -> tuple[int, ...]:
    """The ``eos_token_id`` (int or list) of a Hugging Face directory's
    ``generation_config.json``, else of its ``config.json``; () when neither names one."""
    for name in EOS_FILES if directory else ():
        path = Path(directory) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        if value is not None:
            return tuple(int(v) for v in (value if isinstance(value, list) else [value]))
    return ()


def text_counter(tokenizer: str, byte_vocab: bool) -> Callable[[str], int] | None:
    """How many ids the job makes of a text: bytes, or ``tokenizer`` (a tokenizer.json, or
    a directory holding one) through ``tokenizers``; None when that cannot be known here."""
    if not tokenizer:
        return (lambda text: len(text.encode())) if byte_vocab else None
    path = Path(tokenizer)
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    if not file.is_file():
        return None
    fast = Tokenizer.from_file(str(file))
    return lambda text: len(fast.encode(text).ids)


def prompt_lengths(path: Path, count_text: Callable[[str], int] | None) -> list[tuple[int, int]]:
    """(line number, tokens) of each prompt of a JSONL whose length is known here: every
    ``{"ids": [...]}`` line, and ``{"text": ...}`` lines when ``count_text`` is given."""
    lengths = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"{path} line {number}: not a JSON object") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {number}: not a JSON object")
        if isinstance(record.get("ids"), list):
            lengths.append((number, len(record["ids"])))
        elif count_text is not None and isinstance(record.get("text"), str):
            lengths.append((number, count_text(record["text"])))
    return lengths


def too_long_prompt(generate: GenerateConfig, model: ModelSpec, data: str) -> str | None:
    """The first prompt of ``generate.prompts`` the job would refuse as too long, counted
    as the job counts it (``data``: train.data); a text prompt that cannot be counted
    here is left to the job. None also when the file is not here (the generate command
    checks that it is)."""
    path = Path(generate.prompts)
    if not path.is_file():
        return None
    byte_vocab = has_byte_vocab(data, model.init_from, generate.checkpoint)
    counter = text_counter(tokenizer_path(generate.tokenizer, model.init_from), byte_vocab)
    key = f"generate.prompts={generate.prompts!r}"
    try:
        lengths = prompt_lengths(path, counter)
    except ValueError as exc:
        return f"{key}: {exc}"
    for number, tokens in lengths:
        problem = prompt_length_problem(
            f"{key} line {number}", tokens, "generate.max_new_tokens", generate.max_new_tokens,
            model,
        )  # fmt: skip
        if problem:
            return problem
    return None
