"""A site keeps its machine profiles and its accounts in its own directory, named by
AXONN_SITE_DIR (docs/site.md): every composing command finds them there, a resubmission
finds them again from the job's job.json, and the package is left as it was. The example
(docs/examples/site) holds a variant of the packaged lumi (machine/lumi_small.yaml, through
Hydra's defaults list), a machine of its own (machine/mycluster.yaml) and their accounts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from axonn_launch.config.compose import ConfigError, load, machine_names, using_site
from tests.cli_server import run_module
from tests.conftest import REPO
from tests.fake_slurm import QUIET, SUBMITTED, fake_tools, printing

EXAMPLE = REPO / "docs" / "examples" / "site"
LUMI = ["machine=lumi_small", "model=gpt_5b", "train.data=synthetic", "train.steps=100",
        "train.warmup_steps=10"]  # fmt: skip


def fake_slurm(tmp_path: Path) -> Path:
    """sbatch that submits job 1, sacct that says job 1 lost its node, a quiet squeue."""
    tools = {"sbatch": SUBMITTED, "sacct": printing("1|NODE_FAIL|0:0|n1"), "squeue": QUIET,
             "sinfo": printing("small-g*|n[1-4]")}  # fmt: skip
    return fake_tools(tmp_path / "bin", tools)


def package_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "axonn_launch/"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout  # fmt: skip


def test_launcher_plan_sweep_and_resubmit_use_a_site_outside_the_package(tmp_path):
    site = shutil.copytree(EXAMPLE, tmp_path / "site")
    base = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "AXONN_SITE_DIR")}
    base["PATH"] = f"{fake_slurm(tmp_path)}{os.pathsep}{base['PATH']}"
    env = {**base, "AXONN_SITE_DIR": str(site)}
    before = package_status()

    def run(module: str, args: list[str], environ: dict) -> subprocess.CompletedProcess:
        proc = run_module(module, args, cwd=tmp_path, env=environ, timeout=180)
        assert proc.returncode == 0, proc.stderr
        return proc

    job = tmp_path / "jobs" / "lumi"
    run("axonn_launch", [*LUMI, "grid.x=8", f"hydra.run.dir={job}"], env)
    assert json.loads((job / "job.json").read_text())["site_dir"] == str(site)
    plan = run("axonn_launch.plan", [*LUMI, "nodes=2"], env)
    assert "2 node(s) of lumi_small = 16 GPUs (MI250X-GCD)" in plan.stdout  # the site's profile
    sweep = tmp_path / "sweep"
    run("axonn_launch", ["-m", *LUMI, "grid.x=8,16", "dry_run=true", f"hydra.sweep.dir={sweep}"],
        env)  # fmt: skip
    # the resubmission is told nothing of the site (without it lumi_small is no machine):
    # job.json says where it is
    resubmitted = run("axonn_launch.jobs", ["resubmit", str(job.parent)], base)
    assert "resubmitted 1 (node_failure)" in resubmitted.stdout
    scripts = [job / "submission.sh", *sweep.glob("*/submission.sh"),
               job.with_name("lumi_attempt2") / "submission.sh"]  # fmt: skip
    assert len(scripts) == 4
    for script in scripts:
        text = script.read_text()
        assert "#SBATCH --account=project_465000000" in text, script
        assert "#SBATCH --partition=small-g" in text and "#SBATCH --exclusive" in text, script
    assert package_status() == before


def test_a_site_profile_replaces_the_packaged_one_of_its_name(tmp_path):
    site = shutil.copytree(EXAMPLE, tmp_path / "site")
    frontier = (REPO / "axonn_launch/conf/machine/frontier.yaml").read_text()
    (site / "machine" / "frontier.yaml").write_text(
        frontier.replace("partition: batch", "partition: extended")
    )
    with using_site(str(site)):
        assert load(["machine=frontier"]).machine.slurm.partition == "extended"
        assert {"lumi", "lumi_small", "mycluster"} <= set(machine_names("slurm"))
    assert load(["machine=frontier"]).machine.slurm.partition == "batch"
    assert {"lumi_small", "mycluster"}.isdisjoint(machine_names("slurm"))


def test_a_site_dir_that_is_not_one_is_one_line(tmp_path):
    with using_site(str(tmp_path / "missing")), pytest.raises(ConfigError) as error:
        load(["machine=local"])
    assert str(error.value).startswith(f"AXONN_SITE_DIR='{tmp_path / 'missing'}': not a directory")
    with pytest.raises(ConfigError) as unknown:
        load(["machine=mycluster"])
    assert "set AXONN_SITE_DIR=DIR" in str(unknown.value)


def test_a_broken_site_profile_is_one_line_naming_its_file(tmp_path):
    site = shutil.copytree(EXAMPLE, tmp_path / "site")
    own = site / "machine" / "mycluster.yaml"
    own.write_text(own.read_text().replace("  gpus_per_node: 4\n  gpu_model", "  gpu_model"))
    with using_site(str(site)), pytest.raises(ConfigError) as error:
        load(["machine=mycluster"])
    assert str(error.value).startswith(f"{own}: machine.hardware.gpus_per_node: missing")


def test_a_machine_of_the_sites_own_and_a_variant_of_a_packaged_one(tmp_path):
    """docs/site.md's two kinds of profile: mycluster.yaml, wholly the site's, with the keys
    a Slurm GPU machine must set; lumi_small.yaml, the packaged lumi with its partition
    changed. Both render a batch script with the site's accounts (a dry run, no Slurm)."""
    site = shutil.copytree(EXAMPLE, tmp_path / "site")
    with using_site(str(site)):
        own, small, lumi = (load([f"machine={name}"]).machine
                            for name in ("mycluster", "lumi_small", "lumi"))  # fmt: skip
    assert (own.hardware.gpus_per_node, own.slurm.partition, own.slurm.account) == (
        4, "gpu", "proj-0000")  # fmt: skip
    assert (small.slurm.partition, small.slurm.account) == ("small-g", "project_465000000")
    assert small.env == lumi.env and small.slurm.srun_args == lumi.slurm.srun_args
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["AXONN_SITE_DIR"] = str(site)
    job = tmp_path / "job"
    args = ["machine=mycluster", "model=gpt_5b", "grid.x=8", "dry_run=true",
            f"hydra.run.dir={job}"]  # fmt: skip
    proc = run_module("axonn_launch", args, cwd=tmp_path, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    script = (job / "submission.sh").read_text()
    assert "#SBATCH --account=proj-0000" in script and "#SBATCH --nodes=2" in script
    assert "export NCCL_NET=IB" in script
