"""Configs are found from the repo root, from an editable install and from a wheel,
and the login-node path never imports torch."""

import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

PROBE = "import axonn_launch, sys; print(axonn_launch.__file__)"
DRY = ["-m", "axonn_launch", "machine=frontier", "model=gpt_5b", "grid.x=8", "dry_run=true"]


def make_env(path: Path) -> Path:
    """A bare virtual environment that sees this interpreter's dependencies (not the project)."""
    venv.EnvBuilder(with_pip=False).create(path)
    purelib = next(path.glob("lib/python*/site-packages"))
    deps = [p for p in site.getsitepackages() if "site-packages" in p]
    (purelib / "deps.pth").write_text("\n".join(deps) + "\n")
    return path / "bin" / "python"


def pip(*args, python) -> str:
    """Install into ``python``'s environment; returns what pip printed."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        *args,
    ]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def dry_run(python, cwd, job_dir):
    result = subprocess.run(
        [str(python), "-P", *DRY, f"hydra.run.dir={job_dir}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=1" in result.stdout
    where = subprocess.run(
        [str(python), "-P", "-c", PROBE], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()
    return Path(where)


def test_from_the_repo_root(tmp_path):
    result = subprocess.run(
        [sys.executable, *DRY, f"hydra.run.dir={tmp_path / 'job'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "job" / "submission.sh").exists()


@pytest.mark.slow
def test_from_an_editable_install(tmp_path):
    python = make_env(tmp_path / "venv")
    printed = pip("-e", str(REPO), python=python)
    # a path entry, not setuptools' import finder and its nine-line warning (pyproject.toml)
    assert "Editable installation" not in printed, printed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert dry_run(python, elsewhere, tmp_path / "job").is_relative_to(REPO)


@pytest.mark.slow
def test_from_a_wheel_install(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "deprecated" not in build.stdout + build.stderr  # e.g. a TOML-table license
    (wheel,) = wheels.glob("axonn_launch-*.whl")
    info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"{info}/METADATA").decode()
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert "Apache License" in license_text
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    python = make_env(tmp_path / "venv")
    pip(str(wheel), python=python)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = dry_run(python, elsewhere, tmp_path / "job")
    assert where.is_relative_to(tmp_path / "venv"), where
    assert not where.is_relative_to(REPO)


def test_login_node_path_never_imports_torch(tmp_path):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *DRY, f"hydra.run.dir={tmp_path / 'job'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    imported = {
        line.split("|")[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "axonn_launch.submit.pipeline" in imported and "submitit" in imported
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}
    assert not {m for m in imported if m.startswith("axonn_launch.train")}
