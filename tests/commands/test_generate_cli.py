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


def set_eos(hf_dir: Path, eos: int) -> None:
    """``eos`` as the directory's end-of-sequence id: a list in generation_config.json
    (as Llama 3 has), an int in config.json."""
    for name, value in (("generation_config.json", [eos]), ("config.json", eos)):
        config = json.loads((hf_dir / name).read_text())
        (hf_dir / name).write_text(json.dumps({**config, "eos_token_id": value}))


def test_hf_source_on_a_grid_equals_transformers_and_stops_at_its_eos(tmp_path):
    """The HF config's end-of-sequence id, put on the greedy path of the first prompt (its
    3rd new token), ends that row as transformers' generate ends it; a prompt one token too
    long for model.max_seq_len=128 is refused on the login node, counted as the job counts."""
    hf_dir = tiny_llama_dir(tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    texts = ["To be, or not", "First"]
    expected_prompts = [tokenizer.encode(texts[0]), [5, 6, 7], tokenizer.encode(texts[1])]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    first = torch.tensor([expected_prompts[0]])
    path = hf.generate(first, do_sample=False, max_new_tokens=12, min_new_tokens=12,
                       eos_token_id=None, pad_token_id=0)[0, first.shape[1] :].tolist()  # fmt: skip
    eos = path[2]
    set_eos(hf_dir, eos)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"text": texts[0]}, {"ids": [5, 6, 7]}, {"text": texts[1]}]
    )
    out = tmp_path / "o.jsonl"
    longest = max(len(p) for p in expected_prompts)
    refused = generate(str(hf_dir), f"prompts={prompts}", f"max_new_tokens={129 - longest}",
                       f"out={out}", cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2 and not out.exists(), refused.stderr
    assert refused.stderr.strip() == (
        f"error: generate.prompts={str(prompts)!r} line 1: a prompt of {longest} tokens plus "
        f"generate.max_new_tokens={129 - longest} exceeds model.max_seq_len=128 (at most "
        f"{longest - 1} prompt tokens with {129 - longest} new)"
    )
    result = generate(str(hf_dir), f"prompts={prompts}", "max_new_tokens=12", f"out={out}",
                      "grid.y=2", "grid.z=2", "batch_size=2", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"end-of-sequence id {eos} ({hf_dir}'s eos_token_id)" in result.stdout
    rows = read_rows(out)
    assert [r["prompt_ids"] for r in rows] == expected_prompts  # in the prompts' order
    assert rows[0]["output_ids"] == path[: path.index(eos) + 1]  # it stopped right after it
    for row in rows:
        ids = torch.tensor([row["prompt_ids"]])
        theirs = hf.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
        assert row["output_ids"] == theirs[0, ids.shape[1] :].tolist()
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
    # a generation job's summary and next: line, not a training job's
    assert "ends at    max_new_tokens=8 (this model's vocabulary has no end-of-sequence id)" in (
        result.stdout
    )
    assert "batch " not in result.stdout and "goodput" not in result.stdout
    assert result.stdout.splitlines()[-1].startswith("next: head ./o.jsonl  (one JSON line")
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
