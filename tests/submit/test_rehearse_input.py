"""Bad input for rehearsals and container machines: one line, exit 2, nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import run_launcher

REPO = Path(__file__).resolve().parents[2]
ALPS_EDF = REPO / "machines" / "alps" / "axonn.toml"
ALPS = ["machine=alps", "site.accounts.alps=a-1"]


def refused(result, *needles: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def edf_dir(tmp_path: Path, text: str) -> dict[str, str]:
    folder = tmp_path / "edf"
    folder.mkdir()
    (folder / "axonn.toml").write_text(text)
    return {"EDF_PATH": str(folder), "HOME": str(tmp_path)}


@pytest.mark.parametrize("machine", ["local", "slurm_local"])
def test_rehearsing_a_machine_that_runs_here_is_refused(tmp_path, machine):
    job_dir = tmp_path / "job"
    result = run_launcher(
        [f"machine={machine}", "rehearse=true", f"hydra.run.dir={job_dir}"], cwd=tmp_path
    )
    refused(result, "rehearse=true", f"machine={machine}", "perlmutter, frontier, lumi or alps")
    assert not job_dir.exists()


def test_rehearsal_without_slurm_names_the_start_script(tmp_path):
    job_dir = tmp_path / "job"
    result = run_launcher(
        ["machine=frontier", "rehearse=true", f"hydra.run.dir={job_dir}"],
        cwd=tmp_path,
        env={"PATH": str(tmp_path)},  # no Slurm commands at all
    )
    refused(result, "not running", "machines/slurm_local/start.sh")
    assert not job_dir.exists()


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs Slurm's client commands")
def test_rehearsal_with_the_controller_down_names_the_start_script(tmp_path):
    """A slurm.conf whose controller does not answer: what a stopped local cluster gives."""
    conf = Path("/etc/slurm/slurm.conf")
    text = conf.read_text() if conf.exists() else "ClusterName=axonn\nSlurmctldHost=localhost\n"
    lines = [ln for ln in text.splitlines() if not ln.startswith("SlurmctldPort")]
    (tmp_path / "slurm.conf").write_text("\n".join([*lines, "SlurmctldPort=9"]) + "\n")
    job_dir = tmp_path / "job"
    result = run_launcher(
        ["machine=perlmutter", "rehearse=true", f"hydra.run.dir={job_dir}"],
        cwd=tmp_path,
        env={"SLURM_CONF": str(tmp_path / "slurm.conf")},
        timeout=180,
    )
    refused(result, "local Slurm cluster is not running", "machines/slurm_local/start.sh")
    assert not job_dir.exists()


def test_alps_job_dir_outside_the_mounts_is_refused(tmp_path):
    env = edf_dir(tmp_path, ALPS_EDF.read_text())  # mounts /capstor/ and /iopsstor/ only
    job_dir = tmp_path / "job"
    result = run_launcher([*ALPS, f"hydra.run.dir={job_dir}"], cwd=tmp_path, env=env)
    refused(result, f"job dir {job_dir}", "/capstor/, /iopsstor/", "hydra.run.dir=")
    assert not job_dir.exists()


def test_a_dry_run_only_warns_about_the_mounts(tmp_path):
    env = edf_dir(tmp_path, ALPS_EDF.read_text())
    job_dir = tmp_path / "job"
    result = run_launcher(
        [*ALPS, "dry_run=true", f"hydra.run.dir={job_dir}"], cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "outside the mounts" in result.stderr and "a real submission stops here" in result.stderr
    assert (job_dir / "submission.sh").exists()


def test_a_missing_edf_is_refused(tmp_path):
    job_dir = tmp_path / "job"
    result = run_launcher(
        [*ALPS, f"hydra.run.dir={job_dir}"],
        cwd=tmp_path,
        env={"HOME": str(tmp_path), "EDF_PATH": ""},
    )
    refused(result, "machine.container.environment='axonn'", "EDF search path", "~/.edf/")
    assert not job_dir.exists()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('image = "a/b:1"\nmounts = [\n', "not valid TOML"),
        ('mounts = ["/x/"]\n', "no image"),
    ],
)
def test_a_broken_edf_is_refused(tmp_path, text, why):
    env = edf_dir(tmp_path, text)
    job_dir = tmp_path / "job"
    result = run_launcher([*ALPS, f"hydra.run.dir={job_dir}"], cwd=tmp_path, env=env)
    refused(result, str(tmp_path / "edf" / "axonn.toml"), why)
    assert not job_dir.exists()


def test_a_rehearsal_checks_the_edf_too(tmp_path):
    env = edf_dir(tmp_path, 'image = "a/b:1"\nmounts = [\n')
    job_dir = tmp_path / "job"
    result = run_launcher(
        ["machine=alps", "rehearse=true", f"hydra.run.dir={job_dir}"], cwd=tmp_path, env=env
    )
    refused(result, "not valid TOML")
    assert not job_dir.exists()


def test_a_model_too_big_for_this_computer_is_refused(tmp_path):
    job_dir = tmp_path / "job"
    result = run_launcher(
        ["machine=frontier", "model=gpt_320b", "rehearse=true", f"hydra.run.dir={job_dir}"],
        cwd=tmp_path,
    )
    refused(result, "model=gpt_320b", "model=gpt_tiny or llama_tiny")
    assert not job_dir.exists()


def test_a_rehearsal_runs_on_the_clusters_two_nodes_or_on_one(tmp_path):
    job_dir = tmp_path / "job"
    args = ["machine=frontier", "model=gpt_tiny", "rehearse=true", f"hydra.run.dir={job_dir}"]
    refused(run_launcher([*args, "nodes=3"], cwd=tmp_path), "nodes=3", "set nodes=1")
    assert not job_dir.exists()
    one = run_launcher([*args, "nodes=1", "dry_run=true"], cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert "nodes      1 x 8 tasks" in one.stdout, one.stdout  # frontier's 8 tasks on one node
