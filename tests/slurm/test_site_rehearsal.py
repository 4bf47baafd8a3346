"""The packaged LUMI-G profile, with a site's settings kept outside the package, rehearses on
the local Slurm cluster: one job serves both. ``machine=lumi`` (axonn_launch/conf/machine/
lumi.yaml) with AXONN_SITE_DIR naming a copy of docs/examples/site: the site gives the
account (its local/default.yaml), the job records the site directory, the package is left
as it was, and LUMI's batch script runs as an 8-rank job on one of the cluster's nodes
(``nodes=1``: a rehearsal on one node) and reaches the loss of the same model, grid and seed
on ``machine=local``.

Over 60 s in the suite (79 s beside the other Slurm tests with 16 ranks on 2 nodes; now
8 ranks on one node, half the CPU): in place of the site rehearsal it replaces (the
example's own LUMI-like profile, 106 s, no loss check), so LUMI's rehearsal costs the suite
nothing more. The ``machine=local`` run it is compared with is the one perlmutter's gpt_tiny
rehearsal makes (tests/slurm/test_rehearsal.py: the same model, 8-rank grid and train
settings; the session fixture ``local_losses`` runs it once for both). Two-node rehearsals
of an 8-GCD site: frontier's, in test_rehearsal.py."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.conftest import REPO, run_launcher
from tests.slurm.test_rehearsal import GRID, TRAIN

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

GRID_8 = GRID[8]  # as perlmutter's rehearsal, so that both compare with one local run


def package_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "axonn_launch/"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout  # fmt: skip


def final_loss(job_dir) -> float:
    return json.loads((job_dir / "metrics.jsonl").read_text().splitlines()[-1])["loss"]


def test_lumi_with_a_site_outside_the_package_rehearses_at_the_local_loss(
    slurm_cluster, local_losses, tmp_path
):
    site = shutil.copytree(REPO / "docs" / "examples" / "site", tmp_path / "site")
    before = package_status()
    job_dir = tmp_path / "job"
    args = ["machine=lumi", "model=gpt_tiny", "rehearse=true", "nodes=1", *GRID_8, *TRAIN,
            f"hydra.run.dir={job_dir}"]  # fmt: skip
    result = run_launcher(args, cwd=tmp_path, timeout=900, env={"AXONN_SITE_DIR": str(site)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    record = json.loads((job_dir / "job.json").read_text())
    assert record["status"] == "completed" and record["rehearsal_of"] == "lumi"
    assert record["machine"] == "lumi" and record["nodes"] == 1
    assert record["site_dir"] == str(site)  # a resubmission composes with it again
    site_script = (job_dir / "site_submission.sh").read_text()
    assert "#SBATCH --account=project_465000000\n" in site_script  # the site's account
    assert "#SBATCH --partition=standard-g\n" in site_script  # the package's profile
    assert "#SBATCH --gpus-per-node=8\n" in site_script and "--cpu-bind=mask_cpu:" in site_script
    subs = "\n".join(record["substitutions"])
    assert "partition debug" in subs and "module" in subs, subs
    (job_id,) = record["job_ids"]
    sacct = ["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State"]
    steps = subprocess.run(sacct, capture_output=True, text=True, check=True, timeout=30).stdout
    assert f"{job_id}.0|COMPLETED" in steps, steps
    log = next((job_dir / "slurm" / job_id).glob("*_0_log.out")).read_text()
    assert "8 ranks on 1 host: n" in log
    assert final_loss(job_dir) == local_losses("gpt_tiny", [*GRID_8, *TRAIN])
    assert package_status() == before  # nothing written into the package
