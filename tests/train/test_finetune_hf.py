"""Fine-tuning a Hugging Face Llama end to end on local processes: tokenized
prompt/response data, 5 steps from the HF weights on a 4-rank grid, export, and
``transformers`` loads the result, whose logits equal ours."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_launcher
from tests.hf_fixtures import sft_examples, tiny_llama_dir, write_jsonl

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

SEQ = 32
FINETUNE = [
    "model=hf", "finetune=sft", "train.steps=5", f"train.seq_len={SEQ}",
    "train.global_batch=8", "train.lr=1e-3", "train.warmup_steps=1", "train.eval_batches=1",
    "train.sample_tokens=0",
]  # fmt: skip


def prepare_finetune_data(hf_dir: Path, folder: Path) -> Path:
    """The SFT examples packed into sequences of SEQ + 1 tokens with a loss mask."""
    examples = write_jsonl(folder / "sft.jsonl", sft_examples())
    prefix = folder / "sft"
    subprocess.run(
        [sys.executable, "-m", "axonn_launch.data", "finetune", "--tokenizer", str(hf_dir),
         "--input", str(examples), "--out", str(prefix), "--seq-len", str(SEQ)],
        check=True, cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    return prefix.with_suffix(".bin")


def export_hf(job_dir: Path, out: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "axonn_launch.export", str(job_dir), "--hf", str(out)],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]


def our_logits(job_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the job's last checkpoint, loaded on one rank of our model."""
    from axonn_launch.common.jobdir import resolve_checkpoint
    from axonn_launch.common.models import ModelSpec
    from axonn_launch.common.spec import OverlapConfig
    from axonn_launch.train.checkpoint.state import load_model_weights
    from axonn_launch.train.models.registry import build_model
    from axonn_launch.train.parallel.groups import single_process_groups

    step = resolve_checkpoint(str(job_dir))
    spec = ModelSpec(**json.loads((step / "meta.json").read_text())["model"])
    groups = single_process_groups()
    model = build_model(spec, groups=groups, overlap=OverlapConfig())
    load_model_weights(step, model=model, groups=groups)
    return model.all_logits(tokens)


def check_export(job_dir: Path, hf_dir: Path, out: Path) -> None:
    """The export loads in transformers, equals our logits and moved off the start."""
    export_hf(job_dir, out)
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    tokens = torch.tensor([tokenizer.encode("Say thou twice. thou thou")])
    with torch.no_grad():
        theirs = tuned(tokens).logits
        before = start(tokens).logits
    torch.testing.assert_close(our_logits(job_dir, tokens), theirs, rtol=1e-4, atol=1e-5)
    assert (theirs - before).abs().max() > 1e-3  # fine-tuning changed the model


def test_finetune_from_hf_export_and_reload(tmp_path):
    hf_dir = tiny_llama_dir(tmp_path / "hf")
    data = prepare_finetune_data(hf_dir, tmp_path)
    job_dir = tmp_path / "job"
    result = run_launcher(
        [*FINETUNE, f"model.init_from={hf_dir}", f"train.data={data}", "grid.x=2", "grid.z=2",
         f"hydra.run.dir={job_dir}"],
        cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["val_loss"] > 0
    check_export(job_dir, hf_dir, tmp_path / "exported")
