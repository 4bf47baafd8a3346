"""A site kept outside the package (docs/examples/site, named by AXONN_SITE_DIR) rehearses
on the local Slurm cluster as a packaged site does: its LUMI-like profile's batch script,
with its own account, runs as a 16-rank job on the cluster's 2 nodes and completes."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.conftest import REPO, run_launcher

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TRAIN = ["train.steps=2", "train.sample_tokens=0", "train.gemm_tuning=false",
         "train.eval_batches=0"]  # fmt: skip


def test_a_site_outside_the_package_rehearses_on_the_local_cluster(slurm_cluster, tmp_path):
    site = shutil.copytree(REPO / "docs" / "examples" / "site", tmp_path / "site")
    job_dir = tmp_path / "job"
    args = ["machine=lumi", "model=gpt_tiny", "rehearse=true", "grid.data=2", "grid.x=2",
            "grid.y=2", "grid.z=2", *TRAIN, f"hydra.run.dir={job_dir}"]  # fmt: skip
    result = run_launcher(args, cwd=tmp_path, timeout=900, env={"AXONN_SITE_DIR": str(site)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    record = json.loads((job_dir / "job.json").read_text())
    assert record["status"] == "completed" and record["rehearsal_of"] == "lumi"
    assert record["site_dir"] == str(site)
    assert "#SBATCH --partition=standard-g" in (job_dir / "site_submission.sh").read_text()
    assert "#SBATCH --account=project_465000000" in (job_dir / "site_submission.sh").read_text()
    assert "partition debug" in "\n".join(record["substitutions"])
    (job_id,) = record["job_ids"]
    sacct = ["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State"]
    steps = subprocess.run(sacct, capture_output=True, text=True, check=True, timeout=30).stdout
    assert f"{job_id}.0|COMPLETED" in steps, steps
