"""Fine-tuning a Hugging Face Llama on the real cluster: 2 nodes, 4 ranks (x2 z2), from
the HF directory, then exported and loaded by transformers (logits equal ours)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_launcher
from tests.hf_fixtures import tiny_llama_dir
from tests.train.test_finetune_hf import FINETUNE, check_export, prepare_finetune_data

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_finetune_job_on_two_nodes_exports_to_transformers(slurm_cluster, tmp_path):
    hf_dir = tiny_llama_dir(tmp_path / "hf")
    data = prepare_finetune_data(hf_dir, tmp_path)
    job_dir = tmp_path / "job"
    result = run_launcher(
        [*FINETUNE, "machine=slurm_local", f"model.init_from={hf_dir}", f"train.data={data}",
         "grid.x=2", "grid.z=2", "wait=true", "preflight=false", f"hydra.run.dir={job_dir}"],
        cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((job_dir / "job.json").read_text())
    assert record["status"] == "completed" and record["nodes"] == 2
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["val_loss"] > 0
    check_export(job_dir, hf_dir, tmp_path / "exported")
