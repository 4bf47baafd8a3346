"""Decoding never breaks a run or loses output.

``model=llama_tiny`` (512 ids, byte-level data) trains, samples and generates without a
traceback and ``jobs status`` says COMPLETED; ``generate`` from a 512-token model without a
tokenizer writes ``output_ids`` for every prompt; a step that fails after the training
has finished leaves a COMPLETED job whose record says what did not finish.

One llama_tiny run serves all: it samples (the step that used to raise), then its
memorization measurement fails (its data is not JSON), as a step after training may."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from axonn_launch.train.inference.generation import byte_text, decode
from tests.conftest import run_launcher
from tests.hf_fixtures import tiny_llama_dir, write_jsonl


def run(module: str, *args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def status_row(job_dir: Path, cwd: Path) -> dict:
    shown = run("axonn_launch.jobs", "status", "--json", str(job_dir), cwd=cwd)
    assert shown.returncode == 0, shown.stderr
    (row,) = json.loads(shown.stdout)
    return row


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------ decoding


def test_ids_above_the_bytes_show_as_ids():
    assert byte_text([72, 105, 300, 33]) == "Hi<id:300>!"
    assert byte_text([0xE2, 0x82, 0xAC, 256]) == "\u20ac<id:256>"  # a whole UTF-8 euro
    assert decode([10, 65, 511, 7], "shakespeare") == "\nA<id:511>\\x07"
    assert decode([300, 5], "synthetic") == "300 5"  # no text at all: every id as a number


# -------------------------------------------------------------------------- llama_tiny


@pytest.fixture(scope="module")
def llama_job(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's ``model=llama_tiny``, 3 steps (its sample: 120 tokens), with a
    memorization measurement whose data is not JSON: it fails after the training."""
    cwd = tmp_path_factory.mktemp("llama")
    (cwd / "docs.jsonl").write_text("not json\n")
    job_dir = cwd / "job"
    trained = run_launcher(
        ["model=llama_tiny", "train.steps=3", f"memorization.data={cwd / 'docs.jsonl'}",
         f"hydra.run.dir={job_dir}"],
        cwd=cwd, timeout=600,
    )  # fmt: skip
    return job_dir, trained


@pytest.mark.slow
def test_llama_tiny_trains_samples_and_is_completed(llama_job):
    job_dir, trained = llama_job
    output = trained.stdout + trained.stderr
    assert trained.returncode == 0, output[-3000:]
    assert "Traceback" not in output and "--- sample (120 tokens) ---" in output
    summary = json.loads((job_dir / "summary.json").read_text())
    assert "<id:" in summary["sample"]  # an untrained 512-id model picks ids above 255
    assert json.loads((job_dir / "job.json").read_text())["status"] == "completed"
    row = status_row(job_dir, job_dir.parent)
    assert (row["state"], row["failure"], row["action"]) == ("COMPLETED", "completed", "none")


@pytest.mark.slow
def test_a_step_failing_after_training_is_recorded_not_raised(llama_job):
    """The measurement's failure: one line in the log, the record says it, and the job
    ended well."""
    job_dir, trained = llama_job
    output = trained.stdout + trained.stderr
    assert trained.returncode == 0, output[-3000:]
    assert "memorization failed: MemorizationError" in output
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["after_training"]["sample"] == "done"
    assert summary["after_training"]["memorization"].startswith("failed: MemorizationError")
    table = run("axonn_launch.jobs", "status", str(job_dir), cwd=job_dir.parent).stdout
    assert "COMPLETED" in table.splitlines()[1].split()
    assert "memorization after the training failed: MemorizationError" in table


@pytest.mark.slow
def test_llama_tiny_job_generates_text_and_ids(llama_job):
    job_dir, trained = llama_job
    assert trained.returncode == 0, trained.stderr[-3000:]
    prompts = write_jsonl(job_dir.parent / "p.jsonl", [{"text": "ROMEO:"}, {"ids": [300, 10]}])
    out = job_dir.parent / "o.jsonl"
    made = run("axonn_launch.generate", str(job_dir), f"prompts={prompts}", f"out={out}",
               "max_new_tokens=16", "temperature=1", "grid.x=2", cwd=job_dir.parent)  # fmt: skip
    assert made.returncode == 0 and "Traceback" not in made.stderr, made.stderr[-3000:]
    rows = read_rows(out)
    assert [r["prompt_ids"] for r in rows] == [list(b"ROMEO:"), [300, 10]]
    for row in rows:  # bytes as text, the other ids as <id:N>
        assert len(row["output_ids"]) == 16
        assert row["text"] == byte_text(row["output_ids"])
    assert any(t >= 256 for r in rows for t in r["output_ids"])  # the case that failed


@pytest.mark.slow
def test_a_512_token_model_without_tokenizer_writes_ids_for_every_prompt(tmp_path):
    pytest.importorskip("transformers")
    hf_dir = tiny_llama_dir(tmp_path / "hf", tokenizer=False)  # vocab 512, no tokenizer
    ids = [[5, 300, 7], [511], [1]]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"ids": i} for i in ids])
    out = tmp_path / "o.jsonl"
    made = run("axonn_launch.generate", str(hf_dir), f"prompts={prompts}", f"out={out}",
               "max_new_tokens=5", "grid.y=2", cwd=tmp_path)  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    rows = read_rows(out)
    assert [r["prompt_ids"] for r in rows] == ids
    assert all(len(r["output_ids"]) == 5 and "text" not in r for r in rows)  # its ids are no bytes
    # a text prompt for it is refused on the login node: nothing could encode it
    text = write_jsonl(tmp_path / "t.jsonl", [{"ids": [1]}, {"text": "hello"}])
    refused = run("axonn_launch.generate", str(hf_dir), f"prompts={text}",
                  f"out={tmp_path / 't_out.jsonl'}", cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("\n") == 1 and "line 2: a text prompt needs a tokenizer" in (
        refused.stderr
    )
    assert not (tmp_path / "t_out.jsonl").exists()


# ---------------------------------------------------------------- failures after training


@pytest.mark.slow
def test_a_job_that_crashed_after_training_is_completed(llama_job, tmp_path):
    """A rank that died after the last step (its failure record, exit code 1, the sample
    left pending): the training is complete, and the note says how the job ended."""
    from axonn_launch.common.jobdir import record_failure

    source, trained = llama_job
    assert trained.returncode == 0, trained.stderr[-3000:]
    job_dir = tmp_path / "job"
    shutil.copytree(source, job_dir, ignore=shutil.ignore_patterns("checkpoints", "report"))
    summary = json.loads((job_dir / "summary.json").read_text())
    summary["after_training"] = {"sample": "pending"}
    (job_dir / "summary.json").write_text(json.dumps(summary))
    record = json.loads((job_dir / "job.json").read_text())
    (job_dir / "job.json").write_text(json.dumps(record | {"status": "failed", "exit_code": 1}))
    try:
        raise ValueError("bytes must be in range(0, 256)")
    except ValueError as error:
        record_failure(str(job_dir), 0, error)
    row = status_row(job_dir, tmp_path)
    assert (row["state"], row["failure"]) == ("COMPLETED", "completed")
    assert row["reason"].startswith("training finished, then the job ended")
    assert row["reason"].endswith("failed first: ValueError: bytes must be in range(0, 256)")
    table = run("axonn_launch.jobs", "status", str(job_dir), cwd=tmp_path).stdout
    assert "sample after the training did not finish" in table
    assert json.loads((job_dir / "job.json").read_text())["status"] == "completed"
