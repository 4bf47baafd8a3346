"""machine.python_broadcast in the rendered script: when it is on, what it runs, and the
settings it refuses (tests/slurm/test_rehearsal.py runs it on the local cluster)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from axonn_launch.submit.render import PythonCopy, package_outside
from tests.conftest import REPO, run_launcher

FRONTIER = ["machine=frontier", "model=gpt_tiny", "site.accounts.frontier=acct", "dry_run=true"]
NODES_16 = ["grid.data=16", "grid.x=8", "train.global_batch=16"]  # 128 GCDs = 16 nodes
NODES_8 = ["grid.data=8", "grid.x=8", "train.global_batch=16"]


def dry_run(tmp_path: Path, args: list[str]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    job_dir = tmp_path / "job"
    result = run_launcher([*args, f"hydra.run.dir={job_dir}"], cwd=tmp_path)
    return result, job_dir


def test_frontier_broadcasts_from_16_nodes_to_the_nvme(tmp_path):
    result, job_dir = dry_run(tmp_path, [*FRONTIER, *NODES_16])
    assert result.returncode == 0, result.stderr
    script = (job_dir / "submission.sh").read_text()
    venv = str(Path(sys.executable).parent.parent)
    assert "#SBATCH --constraint=nvme" in script
    lines = script.splitlines()
    setup = [ln for ln in lines if ln.startswith("axonn_setup ")]
    assert f"tar -C {venv} -cf /mnt/bb/" in setup[-4] and "sbcast -f /mnt/bb/" in setup[-3]
    assert "--ntasks-per-node=1" in setup[-2]
    # the job's snapshot of the package (code_snapshot) is packed and put first; without
    # one, this checkout's (tests/submit/test_code_snapshot.py)
    code = job_dir / "code"
    assert f"tar -C {code} -cf /mnt/bb/" in setup[-4] and "export PYTHONPATH=/mnt/bb/" in setup[-1]
    (srun,) = [line for line in lines if line.startswith("srun ")]  # in the restart loop
    assert srun.startswith("srun ") and "/env/bin/python -u -m submitit" in srun
    tasks_python = srun.split(" -u -m ")[0].rsplit(" ", 1)[-1]
    assert tasks_python.startswith("/mnt/bb/") and f"export AXONN_PYTHON_FROM={venv}" in script
    # the copy lands before srun starts, and the start time is taken last
    assert lines.index(setup[-1]) < lines.index('export AXONN_SRUN_START="$(date +%s.%N)"')


def test_below_16_nodes_or_when_turned_off_the_tasks_run_the_venv_in_place(tmp_path):
    for n, args in enumerate(([*FRONTIER, *NODES_8], [*FRONTIER, *NODES_16,
                              "machine.python_broadcast=false"])):  # fmt: skip
        result, job_dir = dry_run(tmp_path / str(n), args)
        assert result.returncode == 0, result.stderr
        script = (job_dir / "submission.sh").read_text()
        assert "sbcast" not in script and "nvme" not in script
        assert f"{sys.executable} -u -m submitit" in script


def test_alps_container_refuses_a_broadcast(tmp_path):
    result, job_dir = dry_run(
        tmp_path, ["machine=alps", "machine.python_broadcast=true", "dry_run=true"]
    )
    assert result.returncode == 2 and not job_dir.exists()
    (line,) = result.stderr.strip().splitlines()
    assert "machine.python_broadcast=true" in line and "container" in line


@pytest.mark.parametrize("dry", [True, False])
def test_an_interpreter_outside_a_venv_cannot_be_copied(tmp_path, dry):
    python = tmp_path / "usr" / "bin" / "python3"  # no pyvenv.cfg or conda-meta beside bin/
    python.parent.mkdir(parents=True)
    python.write_text("")
    args = [*FRONTIER[:-1], *NODES_16, f"machine.python={python}", f"dry_run={str(dry).lower()}"]
    result, job_dir = dry_run(tmp_path, args)
    message = "is not in a venv or conda env"
    if dry:
        assert result.returncode == 0 and message in result.stderr
        assert "a real submission stops here" in result.stderr
    else:
        assert result.returncode == 2 and not job_dir.exists()
        (line,) = result.stderr.strip().splitlines()
        assert message in line and "machine.python_broadcast=false" in line


FAKE_SBCAST = 'cp "$2" "$3"\n'
FAKE_SRUN = 'while [ "${1#-}" != "$1" ]; do shift; done; exec "$@"\n'  # options off, run the rest


def test_the_copy_holds_the_package_the_tasks_import(tmp_path):
    """An editable install leaves the package in the checkout: the copied venv alone would
    still import it from there. Run the batch script's copy commands (sbcast a copy, srun
    a plain run) and check which axonn_launch the copied interpreter imports."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)  # fmt: skip
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("sbcast", FAKE_SBCAST), ("srun", FAKE_SRUN)):
        (bindir / name).write_text("#!/bin/sh\n" + text)
        (bindir / name).chmod(0o755)
    node = tmp_path / "node-local" / "axonn-tag"
    copy = PythonCopy(str(venv), str(node), str(node / "env" / "bin" / "python"),
                      package_outside(str(venv)))  # fmt: skip
    assert copy.package == str(REPO)
    where = f'{copy.python} -c "import axonn_launch; print(axonn_launch.__file__)"'
    script = "\n".join(["set -e", *copy.commands(), where])
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    ran = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         cwd=REPO, timeout=120)  # fmt: skip  # a job started from the checkout
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == str(node / "src" / "axonn_launch" / "__init__.py")
    assert (node / "env" / "pyvenv.cfg").is_file() and not list(tmp_path.glob("node-local/*.tar"))
    assert package_outside(str(REPO)) == ""  # a package inside the copied tree: nothing more
