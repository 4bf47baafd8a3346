"""The launch summary and the ``next:`` line of a generation job (``generate.prompts``).

A generation job has no batch, steps, checkpoint interval or goodput: its summary says
what it continues (the prompts, the new tokens, greedy or sampled), from which weights,
where each continuation ends and where the output goes; its ``next:`` line names the
output file (``report`` has nothing to plot: the job takes no step). Login-node code.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from axonn_launch.common import prompts
from axonn_launch.common.jobdir import JobPaths
from axonn_launch.config.compose import LaunchConfig


def generation_lines(cfg: LaunchConfig) -> list[str]:
    """What the job generates, from what, until when, and where to."""
    gen = cfg.generate
    return [
        f"generate   {prompt_words(cfg)}, {gen.max_new_tokens} new tokens each,"
        f" {decoding_words(cfg)}, batches of {gen.batch_size}",
        f"weights    {weights_words(cfg)}",
        f"ends at    {eos_words(cfg)}",
        f"out        {gen.out}",
    ]


def prompt_words(cfg: LaunchConfig) -> str:
    """``3 prompts of p.jsonl (the longest 19 tokens)``, as far as the login node counts."""
    path = Path(cfg.generate.prompts)
    if not path.is_file():
        return f"the prompts of {cfg.generate.prompts} (not on this computer)"
    byte_vocab = prompts.has_byte_vocab(
        cfg.train.data, cfg.model.init_from, cfg.generate.checkpoint
    )
    tokenizer = prompts.tokenizer_path(cfg.generate.tokenizer, cfg.model.init_from)
    counted = prompts.prompt_lengths(path, prompts.text_counter(tokenizer, byte_vocab))
    lines = sum(1 for line in path.read_text().splitlines() if line.strip())
    words = f"{lines} prompt{'' if lines == 1 else 's'} of {path}"
    if counted and len(counted) == lines:
        words += f" (the longest {max(n for _, n in counted)} tokens)"
    return words


def decoding_words(cfg: LaunchConfig) -> str:
    gen = cfg.generate
    if gen.temperature <= 0:
        return "greedy"
    among = f", top_k={gen.top_k}" if gen.top_k else ""
    seed = f"seeded by train.seed={cfg.train.seed}"
    return f"sampled (temperature={gen.temperature:g}{among}, {seed})"


def weights_words(cfg: LaunchConfig) -> str:
    if cfg.generate.checkpoint:
        return f"checkpoint {cfg.generate.checkpoint}"
    if cfg.model.init_from:
        return f"Hugging Face directory {cfg.model.init_from}"
    return "random initialization (no generate.checkpoint, no model.init_from)"


def eos_words(cfg: LaunchConfig) -> str:
    """Where a continuation ends, by the job's rule (``train/generate_job.eos_ids``)."""
    gen, limit = cfg.generate, f"max_new_tokens={cfg.generate.max_new_tokens}"
    if not gen.stop_at_eos:
        return f"{limit} (generate.stop_at_eos=false)"
    ids = prompts.config_eos_ids(cfg.model.init_from)
    if ids:
        listed = ", ".join(map(str, ids))
        return f"end-of-sequence id {listed} ({cfg.model.init_from}'s eos_token_id), or {limit}"
    tokenizer = prompts.tokenizer_path(gen.tokenizer, cfg.model.init_from)
    if tokenizer and Path(tokenizer).is_dir():
        return f"the end-of-sequence token of {tokenizer}'s tokenizer, if any, or {limit}"
    return f"{limit} (this model's vocabulary has no end-of-sequence id)"


def generation_out(job_dir: Path) -> str:
    """The output file of the generation job in ``job_dir``; "" for any other job."""
    spec = JobPaths(job_dir).spec
    try:
        generate = json.loads(spec.read_text()).get("generate", {})
    except (OSError, ValueError):
        return ""
    return generate.get("out", "") if generate.get("prompts") else ""


def generation_next_line(status: str, out: str, *, ran: bool) -> str:
    """The output to read once the job ran, else its status (``status``: that command)."""
    read = f"head {shlex.quote(out)}"
    if ran and Path(out).is_file():
        return f"next: {read}  (one JSON line per prompt); {status}"
    if ran:
        return f"next: {status}  (no {out}: the job wrote no output)"
    return f"next: {status}  (once it ran: {read})"
