"""Batch scripts per machine: golden reference scripts plus explicit required settings.

The references live in tests/golden/<machine>.sbatch. After a deliberate change to a
profile or the renderer, regenerate them with

    AXONN_UPDATE_GOLDEN=1 python -m pytest tests/submit/test_render.py

and review the diff before committing.
"""

import functools
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from axonn_launch.config.compose import ConfigError, load
from axonn_launch.config.resolve import resolve
from axonn_launch.submit.render import RELAY_SUFFIX, render_script
from axonn_launch.submit.task import apply_task_env
from tests.fake_slurm import fake_tools

GOLDEN = Path(__file__).parents[1] / "golden"
JOB_DIR = Path("/scratch/jobs/run")
PYTHON = "/opt/venv/bin/python"
SCRATCH = "/capstor/scratch/cscs/user"  # $SCRATCH as an Alps login node has it
MACHINE_DIR = Path(__file__).resolve().parents[2] / "axonn_launch" / "conf" / "machine"

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
    "lumi": [
        "machine=lumi",
        "model=gpt_5b",
        "grid.x=8",
        "grid.z=2",
        "site.accounts.lumi=project_4650",
    ],
    "slurm_local": ["machine=slurm_local", "grid.x=2", "grid.z=2"],
}


@pytest.fixture(autouse=True)
def alps_login_environment(monkeypatch):
    """Profiles may read $SCRATCH (Alps: the venv inside the container); fix it."""
    monkeypatch.setenv("SCRATCH", SCRATCH)


@functools.cache
def composed(overrides: tuple[str, ...]):
    """The config and its resolution, composed once per list of overrides (Hydra's compose
    is most of a render's time; the profiles read no variable but $SCRATCH, fixed above)."""
    cfg = load(list(overrides))
    return cfg, resolve(cfg)


def render(overrides, python=PYTHON):
    cfg, resolved = composed(tuple(overrides))
    return render_script(
        machine=cfg.machine,
        nodes=resolved.nodes,
        tasks_per_node=resolved.tasks_per_node,
        job_name=cfg.name,
        folder=JOB_DIR / "slurm" / "%j",
        python=python,
    )


@pytest.mark.parametrize("machine", sorted(CASES))
def test_script_matches_reference(machine):
    script = render(CASES[machine])
    path = GOLDEN / f"{machine}.sbatch"
    if os.environ.get("AXONN_UPDATE_GOLDEN") == "1":
        path.write_text(script)
    assert path.exists(), f"no reference script {path}; run with AXONN_UPDATE_GOLDEN=1"
    assert script == path.read_text(), f"{machine}: script differs from {path}"


def test_no_wckey_unless_the_profile_sets_one():
    """submitit writes ``--wckey=submitit`` by default, which a site enforcing wckeys
    may refuse; only a profile's own ``slurm.extra_sbatch.wckey`` is written."""
    for machine, overrides in CASES.items():
        assert "wckey" not in render(overrides), machine
    given = render([*CASES["slurm_local"], "+machine.slurm.extra_sbatch.wckey=proj_a"])
    assert [ln for ln in given.splitlines() if "wckey" in ln] == ["#SBATCH --wckey=proj_a"]


def sbatch_flags(script):
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, flags=re.M))


def exports(script):
    return dict(re.findall(r"^export (\w+)=(.*)$", script, flags=re.M))


def srun_line(script):
    """submitit's srun command, without the relay that runs it in the background."""
    (line,) = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert line.endswith(RELAY_SUFFIX), line
    return line.removesuffix(RELAY_SUFFIX)


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


def test_alps_runs_in_the_extended_image_with_the_flags_cscs_requires():
    script = render(CASES["alps"])
    flags, env, srun = sbatch_flags(script), exports(script), srun_line(script)
    assert flags["partition"] == "normal" and flags["ntasks-per-node"] == "4"
    # srun, not sbatch, takes --environment; pmix and disable_rdzv_get are required
    assert "--mpi=pmix --network=disable_rdzv_get --environment=axonn " in srun
    assert "environment" not in flags and "network" not in flags
    # the image sets the NCCL/libfabric variables only where unset: never override them
    assert not [key for key in env if key.startswith(("NCCL_", "FI_"))]
    assert env["MPICH_GPU_SUPPORT_ENABLED"] == "0"
    assert f" {SCRATCH}/axonn-venv/bin/python -u -m submitit.core._submit " in srun


def container_machines():
    """Every profile that runs its tasks in a container."""
    from omegaconf import OmegaConf

    found = []
    for path in sorted(MACHINE_DIR.glob("*.yaml")):
        if OmegaConf.load(path).get("container", {}).get("engine"):
            found.append(path.stem)
    return found


def test_alps_is_a_container_machine():
    assert "alps" in container_machines()


@pytest.mark.parametrize("machine", container_machines())
def test_container_srun_line_never_names_the_login_interpreter(machine):
    script = render(CASES[machine], python=sys.executable)
    srun = srun_line(script)
    assert sys.executable not in script
    container_python = load(CASES[machine]).machine.container.python
    assert shlex.split(srun)[-5:-2] == [container_python, "-u", "-m"]


@pytest.mark.parametrize("machine", ["alps", "perlmutter", "slurm_local"])
def test_machine_python_overrides_the_tasks_interpreter(machine):
    srun = srun_line(render([*CASES[machine], "machine.python=/capstor/venvs/ax/bin/python"]))
    assert " /capstor/venvs/ax/bin/python -u -m submitit.core._submit " in srun
    assert PYTHON not in srun and SCRATCH not in srun


def test_bare_metal_machines_run_the_login_nodes_interpreter():
    for machine in ("frontier", "perlmutter", "slurm_local"):
        assert f" {PYTHON} -u -m submitit" in srun_line(render(CASES[machine]))


def test_container_machine_without_its_python_is_refused():
    with pytest.raises(ConfigError, match=r"machine.container.python: empty for 'alps'"):
        load([*CASES["alps"], "machine.container.python="])


def setup_section(script):
    return script.split("# setup\n")[1].split("\n\n# command")[0]


def test_every_setup_line_stops_the_script_with_its_text_when_it_fails(tmp_path):
    script = render([*CASES["slurm_local"], "+machine.setup=['true','export A=1 # note','false']"])
    lines = setup_section(script).splitlines()
    assert lines[1:4] == [
        "axonn_setup 1 true",
        "axonn_setup 2 'export A=1 # note'",
        "axonn_setup 3 false",
    ]
    probe = tmp_path / "setup.sh"
    probe.write_text(setup_section(script) + "\necho reached srun\n")
    run = subprocess.run(["bash", str(probe)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 1 and "reached srun" not in run.stdout
    assert run.stderr.strip() == (
        "axonn_launch: setup line 3 failed (exit 1): false; srun not started"
    )


def test_module_loads_are_checked_like_setup_lines():
    script = render(CASES["frontier"])
    section = setup_section(script)
    assert "axonn_setup 1 'module load PrgEnv-gnu/8.7.0 cpe/26.03" in section
    assert "axonn_setup 2 'export LD_LIBRARY_PATH=" in section


def test_slurm_local_uses_the_same_renderer_with_profile_lines_only():
    local, frontier = render(CASES["slurm_local"]), render(CASES["frontier"])
    assert sbatch_flags(local)["nodes"] == "2" and sbatch_flags(local)["ntasks-per-node"] == "2"
    # Lines that do not come from a profile are identical in both scripts.
    shared = [
        "#!/bin/bash",
        "# Parameters",
        "#SBATCH --open-mode=append",
        "# command",
        "export SUBMITIT_EXECUTOR=slurm",
    ]
    for line in shared:
        assert line in local.splitlines() and line in frontier.splitlines()
    assert (
        srun_line(local).split(" --kill-on-bad-exit=1")[0]
        == srun_line(frontier).split(" --kill-on-bad-exit=1")[0]
    )


# --- signals to the batch shell reach the ranks --------------------------------------------

FAKE_SRUN = """trap 'echo srun got USR2 >> "$RELAY_LOG"' USR2
trap 'echo srun got TERM >> "$RELAY_LOG"; exit 7' TERM
echo srun started >> "$RELAY_LOG"
for _ in $(seq 1000); do [ -e "$RELAY_LOG.stop" ] && exit 3; sleep 0.02; done
exit 9
"""
FAKE_SCANCEL = """echo "scancel $*" >> "$RELAY_LOG"
touch "$RELAY_LOG.stop"
"""


def caught_signals(pid):
    """The signals process ``pid`` has a handler for (/proc: SigCgt)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, flags=re.M)[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def wait_for(predicate, what, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("machine", sorted(CASES))
def test_every_script_runs_srun_in_the_background_and_waits_for_it(machine):
    script = render(CASES[machine])
    command = script.split("# command\n")[1]
    lines = command.splitlines()
    assert lines[-1] == srun_line(script) + ' & axonn_wait "$!"'
    assert lines.index("axonn_wait() {") < lines.index(lines[-1])
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"' in command  # TERM to the steps, not srun


def test_usr2_and_term_to_the_batch_shell_reach_the_step_and_srun_status_is_kept(tmp_path):
    """The rendered script in bash with stand-ins: USR2 to the shell goes to srun, TERM goes
    to the job's steps through scancel (srun itself would kill its step), the shell goes on
    waiting after each, and ends with srun's exit status."""
    bindir = fake_tools(tmp_path / "bin", {"srun": FAKE_SRUN, "scancel": FAKE_SCANCEL},
                        shell="/bin/bash")  # fmt: skip
    script = tmp_path / "job.sh"
    script.write_text(render(CASES["slurm_local"]))
    log = tmp_path / "relay.log"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "RELAY_LOG": str(log), "SLURM_JOB_ID": "42"}
    shell = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path)
    try:
        wait_for(
            lambda: log.exists() and {signal.SIGUSR2, signal.SIGTERM} <= caught_signals(shell.pid),
            "the traps",
        )
        shell.send_signal(signal.SIGUSR2)
        wait_for(lambda: "srun got USR2" in log.read_text(), "USR2 to reach srun")
        shell.send_signal(signal.SIGTERM)
        assert shell.wait(timeout=10) == 3  # srun's own status, after both signals
    finally:
        shell.kill()
        Path(f"{log}.stop").touch()  # ends the stand-in srun, whatever happened
    assert log.read_text().splitlines() == [
        "srun started",
        "srun got USR2",
        "scancel --signal=TERM 42",
    ]


# --- the Flight Recorder on the NCCL/RCCL machines -----------------------------------------

GPU_SITES = ("perlmutter", "frontier", "alps", "lumi")


@pytest.mark.parametrize("machine", GPU_SITES)
def test_gpu_machines_turn_on_the_flight_recorder_with_dumps_in_the_job_dir(
    machine, tmp_path, monkeypatch
):
    """Names every torch from 2.4 to 2.14 reads; the dump prefix is expanded per task from
    the job dir, and its folder made (torch does not make it)."""
    env = exports(render(CASES[machine]))
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    task_env = composed(tuple(CASES[machine]))[0].machine.task_env
    for key in task_env:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    apply_task_env({k: v for k, v in task_env.items() if "{job_dir}" in v}, job_dir=str(tmp_path))
    prefix = tmp_path / "logs" / "flight_recorder" / "rank_"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(prefix)
    assert prefix.parent.is_dir()
