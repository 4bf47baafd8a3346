"""``python -m axonn_launch.generate``: a generation job over a Hugging Face directory or
a training job's checkpoint, on a grid of local processes; bad input stops at the login
node with one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.cli_server import run_module
from tests.conftest import REPO, run_launcher
from tests.hf_fixtures import tiny_llama_dir, write_jsonl

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


def generate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_module("axonn_launch.generate", list(args), cwd=cwd, timeout=600)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_hf_source_on_a_grid_equals_transformers(tmp_path):
    hf_dir = tiny_llama_dir(tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"text": "To be, or not"}, {"ids": [5, 6, 7]}, {"text": "First"}]
    )
    out = tmp_path / "o.jsonl"
    result = generate(str(hf_dir), f"prompts={prompts}", "max_new_tokens=12", f"out={out}",
                      "grid.y=2", "grid.z=2", "batch_size=2", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    expected_prompts = [tokenizer.encode("To be, or not"), [5, 6, 7], tokenizer.encode("First")]
    assert [r["prompt_ids"] for r in rows] == expected_prompts  # in the prompts' order
    for row in rows:
        ids = torch.tensor([row["prompt_ids"]])
        theirs = hf.generate(ids, do_sample=False, max_new_tokens=12, min_new_tokens=12,
                             eos_token_id=None, pad_token_id=0)[0, ids.shape[1] :]  # fmt: skip
        assert row["output_ids"] == theirs.tolist()
        assert row["text"] == tokenizer.decode(row["output_ids"], skip_special_tokens=True)


def test_training_job_source_and_byte_text(tmp_path):
    job_dir = tmp_path / "job"
    trained = run_launcher(
        ["train.steps=3", "train.sample_tokens=0", "train.eval_batches=0",
         f"hydra.run.dir={job_dir}"],
        cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-2000:]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"text": "ROMEO:"}, {"ids": [10, 65]}])
    out = tmp_path / "o.jsonl"
    result = generate(str(job_dir), f"prompts={prompts}", "max_new_tokens=8", f"out={out}",
                      "grid.x=2", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(out)
    assert rows[0]["prompt_ids"] == list(b"ROMEO:") and rows[1]["prompt_ids"] == [10, 65]
    for row in rows:
        assert len(row["output_ids"]) == 8
        assert row["text"] == bytes(row["output_ids"]).decode(errors="replace")
    generate_jobs = list((tmp_path / "jobs").glob("generate-job/*/summary.json"))
    (summary,) = [json.loads(p.read_text()) for p in generate_jobs]
    assert summary["task"] == "generate" and summary["prompts"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["prompts=P", "out=O"], "SOURCE="),
        (["SRC", "out=O"], "prompts=FILE is required"),
        (["SRC", "prompts=missing.jsonl", "out=O"], "no such file"),
        (["SRC", "prompts=BAD", "out=O"], 'expected {"text"'),
        (["SRC", "prompts=P", "out=O", "grid.q=2"], "grid.q"),
    ],
)
def test_bad_input_is_one_line_and_launches_nothing(tmp_path, args, message):
    hf_dir = tiny_llama_dir(tmp_path / "hf", tokenizer=False)
    write_jsonl(tmp_path / "P", [{"ids": [1, 2]}])
    write_jsonl(tmp_path / "BAD", [{"words": "no text"}])
    args = [str(hf_dir) if a == "SRC" else a for a in args]
    args = [a.replace("prompts=P", f"prompts={tmp_path / 'P'}") for a in args]
    args = [a.replace("prompts=BAD", f"prompts={tmp_path / 'BAD'}") for a in args]
    if not any(a == str(hf_dir) for a in args) and args[0].startswith("prompts"):
        args = ["/nonexistent/source", *args]
    result = generate(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "O").exists()


def test_help(tmp_path):
    result = generate("--help", cwd=REPO)
    assert result.returncode == 0 and "prompts=FILE" in result.stdout
