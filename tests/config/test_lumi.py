"""machine=lumi (LUMI-G, conf/machine/lumi.yaml): a dry run with ``show_config=true`` prints
every source the profile cites beside the values, and the script binds as LUMI documents:
all 8 GCDs visible to each task (the node-local rank picks one), each task on the 7 usable
cores of its GCD's CCD. Its golden script: tests/submit/test_render.py; its rehearsal on the
local cluster: tests/slurm/test_site_rehearsal.py."""

from __future__ import annotations

import yaml

from axonn_launch.config.compose import load
from tests.conftest import run_launcher

CONFIG_HEAD = "--- resolved config (with machine.sources) ---\n"
ARGS = ["machine=lumi", "model=gpt_5b", "grid.x=8", "grid.z=2", "site.accounts.lumi=project_1",
        "dry_run=true", "show_config=true"]  # fmt: skip


def test_show_config_prints_lumis_values_with_their_sources(tmp_path):
    proc = run_launcher([*ARGS, f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    shown = proc.stdout.split(CONFIG_HEAD, 1)[1].split("\n--- batch script ---\n")[0]
    sources = load(ARGS[:5]).machine.sources
    assert len(sources) >= 25
    printed = yaml.safe_load(shown)["machine"]
    assert printed["sources"] == sources  # each cited fact with its citation, as printed
    assert printed["env"]["NCCL_SOCKET_IFNAME"] == "hsn" and "env.NCCL_SOCKET_IFNAME" in sources
    assert "Lumi-supercomputer/lumi-userguide:docs/runjobs/scheduled-jobs/partitions.md" in shown
    script = proc.stdout.split("\n--- batch script ---\n", 1)[1]
    assert "#SBATCH --gpus-per-node=8\n" in script and "--gpus-per-task" not in script
    assert "#SBATCH --partition=standard-g\n" in script and "#SBATCH --time=2880\n" in script
    masks = script.split("--cpu-bind=mask_cpu:", 1)[1].split()[0].split(",")
    cores = [{bit for bit in range(64) if int(mask, 16) >> bit & 1} for mask in masks]
    assert all(len(c) == 7 for c in cores) and len(set().union(*cores)) == 56  # 7 each, disjoint
    assert printed["device_index"] == "local_rank"
