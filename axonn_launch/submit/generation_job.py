"""A generation job's launcher command: ``SOURCE`` (a job dir, a ``checkpoints/step_N`` or a
Hugging Face directory) and the generate command's keys checked on the login node and turned
into the launcher's overrides; ``run_generation`` runs such a job and waits for its rows (the
memorization command's generator). Login-node code: no torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from axonn_launch.common.corpus import json_lines
from axonn_launch.common.jobdir import STEP_META, JobPaths
from axonn_launch.records.jobdirs import dry_run_problem

OWN_KEYS = ("prompts", "out", "max_new_tokens", "temperature", "top_k", "batch_size",
            "tokenizer", "stop_at_eos")  # fmt: skip


class GenerateError(ValueError):
    """A user's mistake: one line, exit code 2, nothing launched."""


def launcher_overrides(source: str, keys: dict[str, str]) -> list[str]:
    """The launcher's overrides for a generation job over ``source`` with ``keys``."""
    path = Path(source).expanduser()
    dry_run = dry_run_problem(path)
    if dry_run:
        raise GenerateError(dry_run)
    if (path / "config.json").is_file():
        model = ["model=hf", f"model.init_from={path.resolve()}"]
    elif (path / STEP_META).is_file() or JobPaths(path).latest.is_file():
        model = [f"generate.checkpoint={path.resolve()}", *_training_data(path)]
    else:
        raise GenerateError(
            f"SOURCE={source!r}: not a job directory with checkpoints, a checkpoints/step_N "
            "directory or a Hugging Face directory with config.json"
        )
    for key in ("prompts", "out"):
        if not keys.get(key):
            raise GenerateError(f"{key}=FILE is required (python -m axonn_launch.generate --help)")
    check_prompts(Path(keys["prompts"]), text_codec(path, keys))
    out = Path(keys["out"]).expanduser().resolve()
    if out.is_dir():
        raise GenerateError(f"out={keys['out']!r}: is a directory; name a .jsonl file")
    resolved = {**keys, "prompts": str(Path(keys["prompts"]).resolve()), "out": str(out)}
    return [*model, *(f"generate.{k}={_quoted(v)}" for k, v in resolved.items())]


def _training_data(path: Path) -> list[str]:
    """``train.data`` of the job that wrote the checkpoint (its text codec: bytes for the
    built-in corpus)."""
    for job in (path, path.parent.parent):
        spec = JobPaths(job).spec
        if spec.is_file():
            return [f"train.data={_quoted(json.loads(spec.read_text())['train']['data'])}"]
    return []


def _quoted(value: str) -> str:
    """A value Hydra takes literally whatever characters it holds."""
    text = str(value)
    if text.replace(".", "").replace("_", "").replace("-", "").isalnum():
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def text_codec(source: Path, keys: dict[str, str]) -> str:
    """What turns text into ids for ``source`` ("" when nothing does): ``tokenizer=``, an
    HF directory's tokenizer, or the bytes of a job trained on the built-in corpus (the
    job's rule, ``train/inference/generate_job.py``)."""
    if keys.get("tokenizer"):
        return "tokenizer=" + keys["tokenizer"]
    if (source / "config.json").is_file():
        tokenizers = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
        return "its tokenizer" if any((source / f).is_file() for f in tokenizers) else ""
    data = _training_data(source)
    return "bytes" if not data or data[0] == "train.data=shakespeare" else ""


def check_prompts(path: Path, codec: str = "bytes") -> None:
    """Every line gives ids, or text that ``codec`` (``text_codec``; "": none) encodes."""
    if not path.is_file():
        raise GenerateError(f"prompts={str(path)!r}: no such file")
    for number, record in json_lines(path):
        ids, text = record.get("ids"), record.get("text")
        good_ids = isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)
        if not (good_ids or (isinstance(text, str) and text)):
            raise GenerateError(
                f'prompts={str(path)!r} line {number}: expected {{"text": "..."}} or '
                '{"ids": [non-negative token ids]}'
            )
        if not good_ids and not codec:
            raise GenerateError(
                f"prompts={str(path)!r} line {number}: a text prompt needs a tokenizer and "
                'SOURCE has none; give tokenizer=PATH or {"ids": [...]}'
            )


def split_args(argv: list[str]) -> tuple[str, dict[str, str], list[str]]:
    """(SOURCE, this command's keys, launcher overrides)."""
    positional = [a for a in argv if "=" not in a and not a.startswith("-")]
    if len(positional) != 1:
        raise GenerateError(
            f"expected one SOURCE, got {len(positional)} ({' '.join(positional) or 'none'}); "
            "see python -m axonn_launch.generate --help"
        )
    keys, rest = {}, []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if eq and name in OWN_KEYS:
            keys[name] = value
        elif arg not in positional:
            rest.append(arg)
    return positional[0], keys, rest


def launch_command(argv: list[str]) -> list[str]:
    source, keys, rest = split_args(argv)
    overrides = launcher_overrides(source, keys)
    if not any(a.startswith("name=") for a in rest):
        rest.append(f"name=generate-{Path(source).resolve().name}")
    return [sys.executable, "-m", "axonn_launch", *overrides, *rest]


def run_generation(
    source: str,
    prompts: list[dict],
    *,
    max_new_tokens: int,
    overrides: list[str],
    temperature: float = 0.0,
    top_k: int = 0,
    workdir: str | Path = "jobs/generate-inputs",
) -> list[dict]:
    """Continue ``prompts`` (dicts with ``text`` or ``ids``) as a generation job that
    this call waits for; the output rows in order. Raises RuntimeError if the job fails."""
    folder = Path(workdir) / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    prompt_file, out = folder / "prompts.jsonl", folder / "out.jsonl"
    prompt_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    argv = [
        source, f"prompts={prompt_file}", f"out={out}", f"max_new_tokens={max_new_tokens}",
        f"temperature={temperature}", f"top_k={top_k}", "wait=true",
        "stop_at_eos=false",  # memorization scores the whole continuation; overrides may differ
        *overrides,
    ]  # fmt: skip
    code = subprocess.run(launch_command(argv), check=False).returncode
    if code != 0 or not out.is_file():
        raise RuntimeError(f"generation job failed (exit code {code}); see its job directory")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
