"""A generation job: the weights of a checkpoint or of a Hugging Face directory,
continuations of a JSONL of prompts, one output line per prompt in order.

Prompts are batched by length, split over the grid's data × z planes and continued with
``generation.generate``; rank 0 writes ``generate.out`` and the summary.

Output rows and end of sequence: ``docs/job-side.md`` ("train/inference/generate_job.py").
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from axonn_launch.common import prompts as prompt_files
from axonn_launch.common.jobdir import resolve_checkpoint, write_summary
from axonn_launch.common.spec import JobSpec
from axonn_launch.train.inference.generation import byte_text, generate
from axonn_launch.train.models.gpt import GPT
from axonn_launch.train.models.optim import compute_dtype
from axonn_launch.train.parallel.bootstrap import DistEnv

log = logging.getLogger(__name__)


@dataclass
class Codec:
    """Text to token ids and back: a tokenizer, or bytes for the built-in corpus."""

    encode: Any  # str -> list[int]
    decode: Any  # list[int] -> str
    eos_ids: tuple[int, ...] = ()


def open_codec(tokenizer: str, init_from: str, byte_vocab: bool) -> Codec | None:
    """``generate.tokenizer``, else ``model.init_from``'s tokenizer, else bytes when the
    model's ids are bytes (``byte_vocab``); None when there is none (prompts must then give
    ``ids``, and the outputs have no text)."""
    path = prompt_files.tokenizer_path(tokenizer, init_from)
    if path and Path(path).is_dir():
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(path)
        return Codec(
            lambda text: list(hf.encode(text)),
            lambda ids: hf.decode(ids, skip_special_tokens=True),
            () if hf.eos_token_id is None else (hf.eos_token_id,),
        )
    if path:
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(path)
        return Codec(lambda text: fast.encode(text).ids, fast.decode)
    if byte_vocab:
        return Codec(lambda text: list(text.encode()), byte_text)
    return None


def has_byte_vocab(spec: JobSpec) -> bool:
    """The model's ids are bytes (``prompts.has_byte_vocab``, the login node's rule)."""
    return prompt_files.has_byte_vocab(
        spec.train.data, spec.model.init_from, spec.generate.checkpoint
    )


def eos_ids(spec: JobSpec, codec: Codec | None) -> tuple[int, ...]:
    """Where continuations end: the HF directory's ``eos_token_id``, else the tokenizer's;
    none with ``generate.stop_at_eos=false``."""
    if not spec.generate.stop_at_eos:
        return ()
    return prompt_files.config_eos_ids(spec.model.init_from) or (codec.eos_ids if codec else ())


def read_prompts(path: str, codec: Codec | None) -> list[list[int]]:
    """Token ids of each line of a JSONL of ``{"ids": [...]}`` or ``{"text": ...}``."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "ids" in record:
            prompts.append([int(t) for t in record["ids"]])
        elif codec is None:
            raise ValueError(
                f"{path}:{number}: a text prompt needs a tokenizer (generate.tokenizer)"
            )
        else:
            prompts.append(codec.encode(record["text"]))
    return prompts


def load_weights(spec: JobSpec, model: GPT, group: dist.ProcessGroup | None) -> str:
    """The weights to continue with; returns where they came from."""
    if spec.generate.checkpoint:
        from axonn_launch.train.checkpoint.state import load_model_weights

        path = resolve_checkpoint(spec.generate.checkpoint)
        load_model_weights(path, model=model, groups=model.groups, group=group)
        return str(path)
    if spec.model.init_from:
        from axonn_launch.train.models.hf_import import load_hf_weights

        load_hf_weights(model, model.groups, spec.model.init_from)
        return spec.model.init_from
    log.warning("no generate.checkpoint and no model.init_from: continuing with random weights")
    return "random initialization"


def run_generation_job(
    spec: JobSpec, env: DistEnv, model: GPT, group: dist.ProcessGroup | None
) -> dict:
    gen, device = spec.generate, torch.device(env.device)
    source = load_weights(spec, model, group)
    codec = open_codec(gen.tokenizer, spec.model.init_from, has_byte_vocab(spec))
    prompts = read_prompts(gen.prompts, codec)
    started = time.perf_counter()
    outputs = generate(
        model, prompts, gen.max_new_tokens, batch_size=gen.batch_size, device=device,
        dtype=compute_dtype(spec.train, device), temperature=gen.temperature, top_k=gen.top_k,
        eos_ids=eos_ids(spec, codec), seed=spec.train.seed,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    summary = {
        "task": "generate",
        "weights": source,
        "prompts": len(prompts),
        "new_tokens": sum(len(o) for o in outputs),
        "seconds": seconds,
        "tokens_per_s": sum(len(o) for o in outputs) / seconds if seconds > 0 else None,
        "out": gen.out,
        "text": codec is not None,
    }
    if env.rank == 0:
        write_outputs(Path(gen.out), prompts, outputs, codec)
        write_summary(spec.job_dir, summary)
        log.info("generated %d continuations into %s", len(prompts), gen.out)
    return summary


def write_outputs(
    out: Path, prompts: list[list[int]], outputs: list[list[int]], codec: Codec | None
) -> None:
    """One row per prompt, in order; ``text`` only where the ids can be decoded."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + f".partial-{os.getpid()}")
    with partial.open("w") as f:
        for prompt, new in zip(prompts, outputs):
            row = {"prompt_ids": prompt, "output_ids": new}
            text = decoded(codec, new)
            if text is not None:
                row["text"] = text
            f.write(json.dumps(row) + "\n")
    partial.replace(out)


def decoded(codec: Codec | None, ids: list[int]) -> str | None:
    """The text of ``ids``, or None: no codec, or one that cannot decode them (the ids
    are written all the same)."""
    if codec is None:
        return None
    try:
        return codec.decode(ids)
    except Exception as error:  # a tokenizer's own limits must not lose the output
        log.warning("cannot decode %d ids to text (%s: %s)", len(ids), type(error).__name__, error)
        return None
