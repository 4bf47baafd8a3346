"""Memorization of training documents: greedy continuations scored against the truth.

The measurement of the Goldfish study (Hans et al. 2024, arXiv 2406.10209): each
document's last ``continuation`` tokens are the truth, the rest the prompt, and each
greedy continuation is scored by ``exact_match``, ``token_match`` and ``rouge_l``. The
metric functions are pure Python; generation is ``submit/generation_job.run_generation``.

The metrics, the reference and the data formats: ``docs/data.md`` ("memorization.py").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from axonn_launch.common.memorization_metric import (
    DEFAULT_CHUNK,
    DEFAULT_CONTINUATION,
    DEFAULT_MAX_DOCUMENTS,
    DEFAULT_MAX_LENGTH,
    MemorizationError,
    Settings,
    build_prompts,
    evaluate,
    load_tokenizer,
    model_vocab,
    read_documents,
    write_json,
)
from axonn_launch.submit.generation_job import run_generation
from axonn_launch.usage import help_page, run_tool, wants_help

FORWARDED = ("grid.", "machine", "nodes", "name", "site.", "train.dtype", "stop_at_eos")

Generator = Callable[..., list[dict]]


def measure(settings: Settings, generate: Generator | None = None) -> dict:
    """Read, prompt, generate, score; writes ``settings.out`` and returns its content."""
    source = Path(settings.source)
    if not source.is_dir():
        raise MemorizationError(f"source {source}: not a directory (a checkpoint, job or HF dir)")
    tokenizer = load_tokenizer(source)
    vocab = model_vocab(source)
    documents = read_documents(
        Path(settings.data), tokenizer, chunk=settings.chunk, model_vocab=vocab
    )
    prompts, skipped = build_prompts(documents, settings)
    generate = generate or run_generation
    outputs = (
        generate(
            str(source),
            [{"ids": p["ids"]} for p in prompts],
            max_new_tokens=settings.continuation,
            overrides=list(settings.overrides),
            temperature=0.0,
            top_k=0,
        )
        if prompts
        else []
    )
    result = {"source": str(source), "data": settings.data, "continuation": settings.continuation}
    result |= evaluate(prompts, outputs, tokenizer, skipped)
    write_json(Path(settings.out), result)
    return result


def format_table(result: dict, rows: int = 10) -> str:
    """The summary line and the first ``rows`` documents."""

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [f"{'document':>8}  {'prompt':>6}  {'exact':>5}  {'token':>6}  {'ROUGE-L':>7}"]
    for r in result["documents"][:rows]:
        lines.append(
            f"{r['document']:>8}  {r['prompt_tokens']:>6}  {str(r['exact_match']):>5}"
            f"  {r['token_match']:>6.3f}  {r['rouge_l']:>7.3f}"
        )
    if len(result["documents"]) > rows:
        lines.append(f"{'...':>8}")
    lines.append(
        f"{result['n_documents']} documents ({result['skipped']} skipped, too short):"
        f" exact match {num(result['exact_match_rate'])}, token match"
        f" {num(result['token_match'])}, ROUGE-L {num(result['rouge_l'])}"
        f" (on {result['rouge_on']})"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the CLI

HELP = help_page(
    usage="python -m axonn_launch.memorization SOURCE data=FILE out=FILE [KEY=VALUE ...]",
    summary=(
        "Greedy continuations of training documents scored against the truth (exact match,"
        '\ntoken match, ROUGE-L), the memorization measure of Hans et al. 2024, "Be like a'
        '\nGoldfish" (arXiv 2406.10209), as in arXiv 2502.08145. SOURCE: a checkpoint, job or'
        "\nHugging Face dir."
    ),
    keys=[
        ("data=FILE", '.jsonl of {"ids": [...]} or {"text": ...}, or a token .bin (+ .idx)'),
        ("out=FILE", "the JSON written: summary and one row per document"),
        ("continuation=N", f"tokens generated and compared (default {DEFAULT_CONTINUATION})"),
        ("max_documents=N", f"documents scored (default {DEFAULT_MAX_DOCUMENTS})"),
        (
            "max_length=N",
            f"each document is cut to its first N tokens (default {DEFAULT_MAX_LENGTH})",
        ),
        ("chunk=N", f"a .bin without .idx: documents of N tokens (default {DEFAULT_CHUNK})"),
        ("batch_size=N", "prompts per generation batch (passed to the generation runner)"),
        ("grid.*=N machine=NAME", "where the model runs (passed to the generation runner)"),
        ("nodes= name= site.*=", "more launcher keys for the generation job (passed on)"),
        ("--debug", "a traceback instead of a one-line error"),
    ],
    examples=[
        "python -m axonn_launch.memorization jobs/gpt_tiny-local/2026-12-01_10-00-00"
        " data=docs.jsonl continuation=50 out=memorization.json",
    ],
)

INT_KEYS = ("continuation", "max_documents", "max_length", "chunk")


def parse_args(argv: Sequence[str]) -> Settings:
    sources = [a for a in argv if "=" not in a]
    if len(sources) != 1:
        raise MemorizationError(f"expected one SOURCE directory, got {sources or 'none'}")
    values: dict[str, Any] = {"source": sources[0], "overrides": []}
    for arg in (a for a in argv if "=" in a):
        key, value = arg.split("=", 1)
        if key in INT_KEYS:
            values[key] = _positive_int(key, value)
        elif key in ("data", "out"):
            values[key] = value
        elif key == "batch_size":
            values["overrides"].append(f"batch_size={_positive_int(key, value)}")
        elif key.startswith(FORWARDED):
            values["overrides"].append(arg)
        else:
            valid = ", ".join(("data", "out", *INT_KEYS, "batch_size", "grid.*", "machine"))
            raise MemorizationError(f"{key}={value}: unknown key; valid: {valid}")
    for key in ("data", "out"):
        if key not in values:
            raise MemorizationError(f"{key}= is required")
    return Settings(**values)


def _positive_int(key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise MemorizationError(f"{key}={value}: expected a positive integer")
    return int(value)


def main(argv: list[str] | None = None, generate: Generator | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(HELP)
        return 0

    def _main(args: list[str]) -> int:
        print(format_table(measure(parse_args(args), generate)))
        return 0

    return run_tool(_main, argv, (MemorizationError, json.JSONDecodeError))


if __name__ == "__main__":
    sys.exit(main())
