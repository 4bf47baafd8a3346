"""Continue prompts with a trained or Hugging Face model, on any grid, locally or on Slurm.

    python -m axonn_launch.generate SOURCE prompts=FILE max_new_tokens=N out=FILE [KEY=VALUE ...]

SOURCE is a job directory (its latest checkpoint), a ``checkpoints/step_N`` directory, or a
Hugging Face Llama directory. The command is the launcher with a generation job: the other
``KEY=VALUE`` are launcher overrides (``machine=``, ``grid.*=``, ``name=`` ...), the job
directory is made as for training and ``jobs status`` lists it. Login-node code: no torch.
"""

from __future__ import annotations

import subprocess
import sys

from axonn_launch.common.corpus import DataError
from axonn_launch.submit.generation_job import GenerateError, launch_command
from axonn_launch.usage import help_page, run_tool, wants_help

HELP = help_page(
    usage=(
        "python -m axonn_launch.generate SOURCE prompts=FILE max_new_tokens=N out=FILE "
        "[KEY=VALUE ...]"
    ),
    summary=(
        'Continue each prompt of a JSONL file ({"text": ...} or {"ids": [...]}) with the\n'
        "model of SOURCE (a job directory, a checkpoints/step_N directory or a Hugging Face\n"
        "Llama directory) and write one line per prompt, in order:\n"
        '{"prompt_ids": [...], "output_ids": [new tokens], "text": "..."}. Batched, with a\n'
        "KV cache, on the grid and machine you name (the launcher's keys). Rows have\n"
        '"text" only where the ids have text: a tokenizer, or the bytes of a model trained on\n'
        "the built-in corpus (an id above 255 shows as <id:N>).\n\n"
        "Greedy decoding (the default) of an early checkpoint repeats itself: a model after\n"
        'a few hundred steps continues with spaces or "the the the". Sampling gives text\n'
        "that reads like its training data: temperature=0.8 (with top_k=50, say).\n\n"
        "A prompt plus max_new_tokens must fit model.max_seq_len (64 for gpt_tiny), or the\n"
        "login node refuses it. A continuation ends at the end-of-sequence id, as\n"
        "transformers' generate: the HF config's eos_token_id, else the tokenizer's (a model\n"
        "trained on the built-in byte corpus has none: it writes max_new_tokens)."
    ),
    keys=[
        ("SOURCE", "job dir, checkpoints/step_N, or an HF directory with config.json"),
        ("prompts=FILE", 'JSONL of {"text": ...} or {"ids": [...]} (one prompt per line)'),
        ("out=FILE", "JSONL written when the job ends"),
        ("max_new_tokens=N", "tokens per prompt (default 32); prompt + N <= model.max_seq_len"),
        ("temperature=T top_k=K", "sampling (default greedy: temperature=0; see above)"),
        ("batch_size=B", "prompts per batch (default 16)"),
        ("tokenizer=PATH", "tokenizer.json or HF dir (default: the HF source's, or bytes)"),
        ("stop_at_eos=false", "run N tokens past the end-of-sequence id (default: stop at it)"),
        ("KEY=VALUE", "launcher overrides: machine=, grid.x=, nodes=, name=, site.accounts..."),
    ],
    examples=[
        "python -m axonn_launch.generate jobs/gpt_tiny-local/2026-12-01_08-00-00 "
        "prompts=p.jsonl max_new_tokens=48 out=o.jsonl grid.x=2",
        "python -m axonn_launch.generate /models/Llama-3.2-1B prompts=p.jsonl out=o.jsonl "
        "machine=slurm_local grid.x=2 grid.z=2 wait=true",
    ],
)


def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(HELP)
        return 0
    return subprocess.run(launch_command(argv), check=False).returncode


if __name__ == "__main__":
    sys.exit(run_tool(main, sys.argv[1:], (GenerateError, DataError)))
