"""Which code a job runs (``records/provenance.py``): the revision, diff, versions and
installed distributions in the job dir, the snapshot of the package that every attempt's
script puts first on the path, and the ``jobs status`` line when the installed code moved
on. The snapshot imported by a recovery attempt on the real cluster:
tests/slurm/test_code_snapshot.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from axonn_launch.config.compose import ConfigError, load
from axonn_launch.records import provenance
from axonn_launch.submit import chain, render
from tests.conftest import REPO, run_launcher

SLURM = ["machine=slurm_local", "grid.x=2", "train.steps=4", "force=true", "wait=false"]


def git(root: Path, *args: str) -> str:
    command = ["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """A package of this name at the root of a git checkout of one commit, as the process's
    own (``provenance.PACKAGE``)."""
    root = tmp_path / "checkout"
    package = root / "axonn_launch"
    (package / "__pycache__").mkdir(parents=True)
    (package / "__init__.py").write_text("SCALE = 1.0\n")
    (package / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (root / ".gitignore").write_text("__pycache__/\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "one")
    monkeypatch.setattr(provenance, "PACKAGE", package)
    return root


def test_a_dirty_checkout_records_its_revision_and_saves_its_diff(checkout, tmp_path):
    (checkout / "axonn_launch" / "__init__.py").write_text("SCALE = 2.0\n")
    (checkout / "notes.txt").write_text("new\n")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    found = provenance.record(job_dir, snapshot=True)
    assert found["revision"] == git(checkout, "rev-parse", "HEAD").strip()
    assert found["dirty"] is True and found["untracked"] == ["notes.txt"]
    assert found["diff"] == "code.diff" and "+SCALE = 2.0" in (job_dir / "code.diff").read_text()
    copy = job_dir / "code" / "axonn_launch"
    assert (copy / "__init__.py").read_text() == "SCALE = 2.0\n"  # as it is at submission
    assert not (copy / "__pycache__").exists()
    assert found["snapshot"] == "code" and found["hash"] == provenance.package_hash(copy)
    assert found["hash"] == provenance.package_hash(provenance.PACKAGE)  # no .pyc in either


def test_a_clean_checkout_writes_no_diff_and_a_dry_run_no_file(checkout, tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    found = provenance.record(job_dir, snapshot=True, dry_run=True)
    assert found["dirty"] is False and "diff" not in found and "hash" not in found
    assert found["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert list(job_dir.iterdir()) == []  # a dry run copies and writes nothing


def test_a_package_outside_a_checkout_has_no_revision(tmp_path, monkeypatch):
    package = tmp_path / "site-packages" / "axonn_launch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.setattr(provenance, "PACKAGE", package)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    found = provenance.record(job_dir, snapshot=False)
    assert "revision" not in found and found["snapshot"] is None
    assert not (job_dir / "code").exists()
    assert found["hash"] == provenance.package_hash(package)


def test_a_recovery_attempt_launched_from_a_snapshot_keeps_the_runs_revision(tmp_path, monkeypatch):
    first = tmp_path / "run"
    (first / "code" / "axonn_launch").mkdir(parents=True)
    (first / "code.diff").write_text("+SCALE = 2.0\n")
    given = {"revision": "abc", "dirty": True, "untracked": [], "diff": "code.diff"}
    (first / "job.json").write_text(json.dumps({"job_ids": ["7"], "provenance": given}))
    monkeypatch.setattr(provenance, "PACKAGE", first / "code" / "axonn_launch")
    attempt = tmp_path / "run_attempt2"
    attempt.mkdir()
    found = provenance.record(attempt, snapshot=True)
    assert found["revision"] == "abc" and found["dirty"] is True
    assert found["inherited_from"] == str(first)
    assert (attempt / "code.diff").read_text() == "+SCALE = 2.0\n"
    assert (attempt / "code" / "axonn_launch").is_dir()


def test_versions_and_distributions_are_read_without_importing_torch(tmp_path):
    freeze = tmp_path / "freeze.txt"
    probe = (
        "import json, sys; from pathlib import Path;"
        "from axonn_launch.records import provenance as p;"
        f"p.write_freeze(Path({str(freeze)!r})); v = p.versions();"
        "assert 'torch' not in sys.modules, 'torch imported'; print(json.dumps(v))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    from importlib.metadata import version

    assert found["torch"] == version("torch") and found["axonn_launch"] == version("axonn_launch")
    assert found["collectives"]  # gloo on a CPU build, nccl or rccl on a GPU build
    lines = freeze.read_text().splitlines()
    assert f"torch=={version('torch')}" in lines
    assert f"-e {REPO}" in lines  # this checkout's editable install, as pip writes it


def test_the_collective_library_in_words():
    assert provenance.collectives({"cuda": None, "hip": None}) == "gloo (a CPU build of torch)"
    assert provenance.collectives({"hip": "6.1"}).startswith("rccl (bundled with torch")
    assert provenance.collectives({"cuda": "12.4"}).startswith("nccl")


def test_the_installed_code_against_the_submitted_one(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "installed_hash", lambda: "sha256:new")
    snapshot = {"provenance": {"hash": "sha256:old", "snapshot": "code"}}
    (line,) = provenance.code_warnings(tmp_path, snapshot)
    assert line.startswith("warning: code: the installed ") and f"{tmp_path}/code" in line
    (line,) = provenance.code_warnings(tmp_path, {"provenance": {"hash": "sha256:old"}})
    assert "later attempts (requeues, recovery) import the installed code" in line
    assert provenance.code_warnings(tmp_path, {"provenance": {"hash": "sha256:new"}}) == []
    assert provenance.code_warnings(tmp_path, {}) == []  # a job from before provenance


def test_the_import_line_puts_the_snapshot_before_the_working_directory(tmp_path):
    for folder, where in ((tmp_path / "code", "snapshot"), (tmp_path / "cwd", "checkout")):
        (folder / "axonn_launch").mkdir(parents=True)
        (folder / "axonn_launch" / "__init__.py").write_text(f"WHERE = {where!r}\n")
    script = (
        f"{provenance.import_first(tmp_path / 'code')}\n"
        f"{sys.executable} -c 'import axonn_launch; print(axonn_launch.WHERE)'"
    )
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path / "cwd", capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert done.stdout.strip() == "snapshot"


def test_on_by_default_on_slurm_machines_only_and_refused_locally():
    assert provenance.snapshot_on(load(["machine=slurm_local"]))
    assert not provenance.snapshot_on(load(["machine=slurm_local", "code_snapshot=false"]))
    assert not provenance.snapshot_on(load([]))  # machine=local
    with pytest.raises(ConfigError, match=r"^code_snapshot=true: machine=local .* false"):
        load(["code_snapshot=true"])
    with pytest.raises(ConfigError, match=r"^code_snapshot='maybe': expected true or false"):
        load(["machine=slurm_local", "code_snapshot=maybe"])


def test_the_recovery_job_launches_from_the_snapshot(tmp_path):
    cfg = load(["machine=slurm_local"])
    script = chain.recovery_script(cfg, tmp_path)
    line = provenance.import_first(tmp_path / "code")
    assert f"\n{line}\nexec " in script
    off = load(["machine=slurm_local", "code_snapshot=false"])
    assert "PYTHONPATH" not in chain.recovery_script(off, tmp_path)


def test_a_node_local_copy_carries_the_snapshot_not_the_checkout(tmp_path):
    machine = load(["machine=frontier"]).machine
    copy = render.PythonCopy(source="/venv", dir="/mnt/bb/u/axonn-1", python="/x", package="/co")
    snapshot = render.setup_lines(machine=machine, nodes=16, copy=copy, code="/job/code")
    checkout = render.setup_lines(machine=machine, nodes=16, copy=copy)
    assert any("tar -C /job/code -cf" in line for line in snapshot)
    assert any("tar -C /co -cf" in line for line in checkout)
    assert not any("/job/code" in line and "PYTHONPATH" in line for line in snapshot)


def test_a_slurm_submission_snapshots_the_package_and_its_script_imports_it(tmp_path, fake_sbatch):
    bindir, _ = fake_sbatch
    job_dir = tmp_path / "job"
    result = run_launcher([*SLURM, f"hydra.run.dir={job_dir}"], cwd=tmp_path, path_prefix=bindir)
    assert result.returncode == 0, result.stderr
    found = json.loads((job_dir / "job.json").read_text())["provenance"]
    assert found["revision"] == git(REPO, "rev-parse", "HEAD").strip()
    assert found["versions"]["torch"] and found["versions"]["python"]
    assert (job_dir / "code.diff").is_file() == found["dirty"]
    assert "\ntorch==" in (job_dir / "pip_freeze.txt").read_text()
    copy = job_dir / "code" / "axonn_launch"
    assert found["hash"] == provenance.package_hash(copy)
    assert (copy / "records" / "provenance.py").is_file()
    line = provenance.import_first(job_dir / "code")
    script = (job_dir / "submission.sh").read_text()  # the attempt: before srun's start time
    assert f"\n{line} AXONN_SRUN_START=" in script
    assert f"\n{line}\nexec " in (job_dir / "recovery.sh").read_text()  # the next one's launch


def test_without_a_snapshot_a_node_local_copy_carries_the_checkout(tmp_path):
    job_dir = tmp_path / "job"
    args = ["machine=frontier", "site.accounts.frontier=acct", "dry_run=true", "grid.data=16",
            "grid.x=8", "train.global_batch=16", "code_snapshot=false",
            f"hydra.run.dir={job_dir}"]  # fmt: skip
    result = run_launcher(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    script = (job_dir / "submission.sh").read_text()
    assert f"tar -C {REPO} -cf /mnt/bb/" in script and str(job_dir / "code") not in script
