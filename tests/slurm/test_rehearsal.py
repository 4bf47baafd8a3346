"""Rehearsals: each site machine's real batch script runs on the local Slurm cluster.

For perlmutter, frontier and alps with gpt_tiny (each site once: the site's script does not
depend on the model, and every site-model pair cost the suite three more 8- or 16-rank
jobs; perlmutter and alps, 8 ranks each, compare with one local run), on two nodes with the
machine's own tasks per node: the rehearsed job completes, its loss equals the same model,
grid and seed on ``machine=local``, its ``job.json`` lists what was substituted, and
``sacct`` shows its step. Alps runs under a real ``srun --mpi=pmix`` with no mpi4py in its
tasks' environment (the EDF's ``[env]`` puts a package that refuses to import first).
The perlmutter gpt_tiny rehearsal also broadcasts the venv to node-local storage
(``machine.python_broadcast=true``): a venv of its own whose packages are links to this
one's (``linked_venv``), so that the pack, sbcast, unpack and run-the-copy path is the
product's while the bytes sent are kilobytes, not this venv's 1.5 GB (which cost about
150 s of the two cores for each run of the suite).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import run_launcher

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
ALPS_EDF = REPO / "machines" / "alps" / "axonn.toml"
TASKS_PER_NODE = {"perlmutter": 4, "frontier": 8, "alps": 4}
GRID = {  # two nodes' worth of ranks
    8: ["grid.x=2", "grid.y=2", "grid.z=2"],
    16: ["grid.data=2", "grid.x=2", "grid.y=2", "grid.z=2"],
}
TRAIN = [
    "train.steps=2",
    "train.sample_tokens=0",
    "train.gemm_tuning=false",
    "train.eval_batches=0",
]
BROADCAST = ("perlmutter", "gpt_tiny")  # the rehearsal that also copies the venv to the nodes
NO_MPI4PY = "raise ImportError('mpi4py is not in this container')\n"


def final_loss(job_dir: Path) -> float:
    lines = (job_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["loss"]


def sacct_steps(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    return dict(line.split("|", 1) for line in out.splitlines() if line.strip())


@pytest.fixture(scope="module")
def linked_venv(tmp_path_factory) -> Path:
    """A venv (its own ``bin/python`` and ``pyvenv.cfg``) whose site-packages entries are
    absolute links to this venv's: it runs as this one does from wherever it is copied."""
    root = tmp_path_factory.mktemp("linked") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)  # fmt: skip
    ours = Path(sysconfig.get_paths()["purelib"])
    (theirs,) = root.glob("lib/python*/site-packages")
    for entry in ours.iterdir():
        (theirs / entry.name).symlink_to(entry)
    return root


def run_in(venv: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m axonn_launch ARGS`` with the interpreter of ``venv``."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    command = [str(venv / "bin" / "python"), "-m", "axonn_launch", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def alps_edf(tmp_path: Path) -> dict[str, str]:
    """The project's EDF, found through EDF_PATH as srun would, with a venv that has no
    mpi4py: a package of that name that refuses to import comes first on the path."""
    stub = tmp_path / "container-site-packages" / "mpi4py"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(NO_MPI4PY)
    edf_dir = tmp_path / "edf"
    edf_dir.mkdir()
    text = ALPS_EDF.read_text().replace("[env]\n", f'[env]\nPYTHONPATH = "{stub.parent}"\n', 1)
    (edf_dir / "axonn.toml").write_text(text)
    return {"EDF_PATH": str(edf_dir)}


@pytest.mark.parametrize(
    ("machine", "model"),
    [("perlmutter", "gpt_tiny"), ("frontier", "gpt_tiny"), ("alps", "gpt_tiny")],
)
def test_rehearsal_runs_the_sites_script_and_matches_local(
    slurm_cluster, local_losses, linked_venv, tmp_path, machine, model
):
    """Over 60 s: the site's script as an 8- or 16-rank job on 2 nodes of 2 cores, and,
    once per model and size, the same run on machine=local."""
    world = 2 * TASKS_PER_NODE[machine]
    env = alps_edf(tmp_path) if machine == "alps" else {}
    job_dir = tmp_path / "job"
    args = [f"machine={machine}", f"model={model}", "rehearse=true", *GRID[world], *TRAIN,
            f"hydra.run.dir={job_dir}"]  # fmt: skip
    broadcast = (machine, model) == BROADCAST
    if broadcast:  # launched from the linked venv: a rehearsal's tasks run the login's Python
        result = run_in(linked_venv, [*args, "machine.python_broadcast=true"], cwd=tmp_path)
    else:
        result = run_launcher(args, cwd=tmp_path, timeout=900, env=env)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    record = json.loads((job_dir / "job.json").read_text())
    assert record["status"] == "completed" and record["rehearsal_of"] == machine
    assert record["machine"] == machine and record["nodes"] == 2
    subs = "\n".join(record["substitutions"])
    for listed in ("module", "partition debug", "CPUs per task", "gloo on the CPU"):
        assert listed in subs, subs
    assert "rehearsal" in result.stdout and "substituted" in result.stdout
    (job_id,) = record["job_ids"]
    assert sacct_steps(job_id).get(f"{job_id}.0") == "COMPLETED", sacct_steps(job_id)
    status = subprocess.run(
        [sys.executable, "-m", "axonn_launch.jobs", "status", str(job_dir)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert f"{job_id} " in status and "COMPLETED" in status, status  # like any other job
    log = next((job_dir / "slurm" / job_id).glob("*_0_log.out")).read_text()
    assert f"{world} ranks on 2 hosts: n1, n2" in log
    site = (job_dir / "site_submission.sh").read_text()
    script = (job_dir / "submission.sh").read_text()
    exports = [line for line in site.splitlines() if line.startswith("export ")]
    assert exports and all(line in script for line in exports)  # every variable kept
    if machine == "alps":
        assert "--mpi=pmix" in script and "--environment=" in site
        assert "--environment=" not in script and "export PYTHONPATH=" in script
        assert "ranks from slurm step (srun --mpi=pmix)" in log
        assert "dropped; its EDF" in subs and "outside the container's mounts" in result.stderr
    else:
        assert "--mpi=cray_shasta" in script
        assert "ranks from slurm step (srun --mpi=cray_shasta)" in log
        modules = (job_dir / "slurm" / job_id).glob("*_0_log.err")
        assert "axonn_launch rehearsal: module load" in next(modules).read_text()
    assert final_loss(job_dir) == local_losses(model, [*GRID[world], *TRAIN])
    if broadcast:
        check_python_broadcast(job_dir, record, script, log, linked_venv)


def check_python_broadcast(job_dir: Path, record: dict, script: str, log: str, venv: Path) -> None:
    """machine.python_broadcast=true, rehearsed: the batch script packs this venv, sbcasts it
    to each node's own storage (start.sh gives every local slurmd a private /mnt/node-local)
    and the ranks run the copy; the start-up record says so and how long start-up took.
    (Once a test of its own; it runs inside the perlmutter gpt_tiny rehearsal, whose every
    assertion holds with the broadcast on, to save a second 8-rank job and venv copy.)"""
    copy = script.split(" -u -m submitit")[0].rsplit(" ", 1)[-1]
    assert copy.startswith("/mnt/node-local/axonn-") and copy.endswith("/env/bin/python")
    assert "sbcast -f" in script and "node-local storage" in "\n".join(record["substitutions"])
    assert f"startup: interpreter {copy} (copied to node-local storage from {venv})" in log
    assert "startup: srun to training: median" in log and "slowest rank" in log
    startup = json.loads((job_dir / "summary.json").read_text())["startup"]
    took = startup["srun_to_training_s"]
    assert startup["ranks_timed"] == 8 and 0 < took["median"] <= took["slowest"]["seconds"]
    tag = copy.split("/")[3]
    state = Path("/var/lib/axonn-slurm")  # machines/slurm_local/lib.sh: STATE_DIR/local-<node>
    try:
        for node in ("n1", "n2"):  # each node unpacked its own copy
            assert (state / f"local-{node}" / tag / "env" / "pyvenv.cfg").is_file(), node
        assert not Path(f"/mnt/node-local/{tag}").exists()  # not visible outside the nodes
    finally:
        for node in ("n1", "n2"):
            subprocess.run(["rm", "-rf", str(state / f"local-{node}" / tag)], check=False)


def test_a_real_pmix_step_is_read_from_slurm(slurm_cluster):
    """The variables ``srun --mpi=pmix`` really sets (PMIX_RANK among them) lead to Slurm's
    ranks, in a process where mpi4py cannot be imported."""
    code = (
        "import json, os, sys; sys.modules['mpi4py'] = None;"
        "from axonn_launch.common.spec import RuntimeConfig;"
        "from axonn_launch.train.parallel.bootstrap import discover_env;"
        "e = discover_env(RuntimeConfig(device='cpu'));"
        "print(json.dumps({'rank': e.rank, 'world': e.world_size, 'source': e.source,"
        " 'pmix': os.environ.get('PMIX_RANK')}))"
    )
    out = subprocess.run(
        ["srun", "--mpi=pmix", "-N2", "-n4", "-p", slurm_cluster.partition, "--time=2",
         sys.executable, "-c", code],
        capture_output=True, text=True, timeout=180, check=True,
    ).stdout  # fmt: skip
    rows = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["source"] == "slurm" for r in rows)
    assert [r["pmix"] for r in rows] == ["0", "1", "2", "3"]  # the pmix plugin really ran
