"""Batch scripts per machine: golden reference scripts plus explicit required settings.

The references live in tests/golden/<machine>.sbatch. After a deliberate change to a
profile or the renderer, regenerate them with

    AXONN_UPDATE_GOLDEN=1 python -m pytest tests/test_render.py

and review the diff before committing.
"""

import os
import re
from pathlib import Path

import pytest

from axonn_launch.config import load
from axonn_launch.render import render_script
from axonn_launch.validate import resolve

GOLDEN = Path(__file__).parent / "golden"
JOB_DIR = Path("/scratch/jobs/run")
PYTHON = "/opt/venv/bin/python"

CASES = {
    "frontier": [
        "machine=frontier",
        "model=gpt_5b",
        "grid.x=8",
        "grid.z=2",
        "site.accounts.frontier=CSC000",
    ],
    "perlmutter": [
        "machine=perlmutter",
        "model=gpt_5b",
        "grid.x=4",
        "grid.z=2",
        "site.accounts.perlmutter=m0000_g",
    ],
    "alps": ["machine=alps", "model=gpt_5b", "grid.x=4", "grid.z=2", "site.accounts.alps=a-00"],
    "slurm_local": ["machine=slurm_local", "grid.x=2", "grid.z=2"],
}


def render(overrides):
    cfg = load(overrides)
    resolved = resolve(cfg)
    return render_script(
        machine=cfg.machine,
        nodes=resolved.nodes,
        tasks_per_node=resolved.tasks_per_node,
        job_name=cfg.name,
        folder=JOB_DIR / "slurm" / "%j",
        python=PYTHON,
    )


@pytest.mark.parametrize("machine", sorted(CASES))
def test_script_matches_reference(machine):
    script = render(CASES[machine])
    path = GOLDEN / f"{machine}.sbatch"
    if os.environ.get("AXONN_UPDATE_GOLDEN") == "1":
        path.write_text(script)
    assert path.exists(), f"no reference script {path}; run with AXONN_UPDATE_GOLDEN=1"
    assert script == path.read_text(), f"{machine}: script differs from {path}"


def sbatch_flags(script):
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, flags=re.M))


def exports(script):
    return dict(re.findall(r"^export (\w+)=(.*)$", script, flags=re.M))


def srun_line(script):
    (line,) = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    return line


def test_frontier_carries_rccl_libfabric_and_binding_settings():
    script = render(CASES["frontier"])
    flags, env, srun = sbatch_flags(script), exports(script), srun_line(script)
    assert flags["nodes"] == "2" and flags["ntasks-per-node"] == "8"
    assert flags["network"] == "disable_rdzv_get" and flags["account"] == "CSC000"
    assert flags["cpus-per-task"] == "7" and flags["gpus-per-task"] == "1"
    assert flags["gpu-bind"] == "closest" and flags["partition"] == "batch"
    assert "--cpus-per-task=7 --gpus-per-task=1 --gpu-bind=closest" in srun
    assert env["NCCL_NET"] == "OFI" and env["FI_CXI_RDZV_PROTO"] == "alt_read"
    for key in (
        "FI_CXI_DISABLE_HOST_REGISTER",
        "FI_CXI_DEFAULT_CQ_SIZE",
        "FI_MR_CACHE_MONITOR",
        "FI_CXI_RDZV_EAGER_SIZE",
        "FI_CXI_RDZV_THRESHOLD",
        "FI_CXI_RDZV_GET_MIN",
    ):
        assert key in env
    assert "rccl-net-plugin" in script and "rocm/" in script


def test_frontier_single_node_leaves_rccl_on_shared_memory():
    script = render(
        [
            "machine=frontier",
            "model=gpt_5b",
            "grid.x=8",
            "site.accounts.frontier=CSC000",
            "train.micro_batch=2",
        ]
    )
    assert "NCCL_NET" not in exports(script) and sbatch_flags(script)["nodes"] == "1"


def test_perlmutter_carries_nccl_ofi_settings_and_regular_qos():
    script = render(CASES["perlmutter"])
    flags, env = sbatch_flags(script), exports(script)
    assert flags["constraint"] == "gpu" and flags["qos"] == "regular"
    assert flags["gpus-per-node"] == "4" and flags["ntasks-per-node"] == "4"
    assert flags["gpu-bind"] == "none" and "exclusive" in flags and flags["nodes"] == "2"
    assert env["NCCL_NET"] == "'AWS Libfabric'"
    assert env["FI_CXI_DISABLE_HOST_REGISTER"] == "1"
    assert env["FI_MR_CACHE_MONITOR"] == "userfaultfd" and env["NCCL_CROSS_NIC"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "3,2,1,0"


def test_alps_carries_gh200_settings_and_container_environment():
    script = render(CASES["alps"])
    flags, env = sbatch_flags(script), exports(script)
    assert flags["partition"] == "normal" and flags["ntasks-per-node"] == "4"
    assert env["NCCL_PROTO"] == "'^LL128'" and env["NCCL_NET"] == "'AWS Libfabric'"
    assert env["FI_CXI_RX_MATCH_MODE"] == "software"
    assert "--environment=axonn" in srun_line(script)


def test_slurm_local_uses_the_same_renderer_with_profile_lines_only():
    local, frontier = render(CASES["slurm_local"]), render(CASES["frontier"])
    assert sbatch_flags(local)["nodes"] == "2" and sbatch_flags(local)["ntasks-per-node"] == "2"
    # Lines that do not come from a profile are identical in both scripts.
    shared = [
        "#!/bin/bash",
        "# Parameters",
        "#SBATCH --open-mode=append",
        "#SBATCH --wckey=submitit",
        "# command",
        "export SUBMITIT_EXECUTOR=slurm",
    ]
    for line in shared:
        assert line in local.splitlines() and line in frontier.splitlines()
    assert (
        srun_line(local).split(" --kill-on-bad-exit=1")[0]
        == srun_line(frontier).split(" --kill-on-bad-exit=1")[0]
    )
