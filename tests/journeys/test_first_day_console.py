"""The console, through the command a user types: the default local run's
console holds a handful of INFO lines and none per GEMM shape (those go to the rank files,
at DEBUG), says at once that the ranks are starting, and ends with a ``next:`` line whose
commands run as printed; a detached Slurm submission ends with one too."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from axonn_launch.scheduler import processes
from tests.conftest import run_launcher

# startup (4), training, the GEMM tuning summary, step 1, step 2, the sample, done: 10; and,
# when the sample is predicted to take over SILENT_S (train/run.py, on a loaded machine), the
# line that announces it
MAX_INFO_LINES = 10
ANNOUNCED = "tokens from the trained model: about"


def run_copied(command: str, cwd) -> subprocess.CompletedProcess:
    """A command from a ``next:`` line, as a user pastes it into a shell."""
    return subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.slow
def test_the_default_run_is_quiet_starts_visibly_and_says_what_is_next(tmp_path):
    proc = run_launcher(["train.steps=2", "hydra.run.dir=jobs/default"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    job_dir_at = next(i for i, ln in enumerate(lines) if ln.startswith("job dir    "))
    assert lines[job_dir_at + 1].startswith("starting 4 ranks (rank 0 logs here")

    info = [ln for ln in lines if " INFO axonn_launch." in ln and ANNOUNCED not in ln]
    assert 0 < len(info) <= MAX_INFO_LINES, "\n".join(info)
    gemm_logger = "axonn_launch.train.parallel.gemm"
    assert not any(gemm_logger in ln for ln in lines), "a GEMM line on the console"
    assert sum("gemm tuning in step 1:" in ln for ln in info) == 1  # the one summary line
    sample_at = next(i for i, ln in enumerate(lines) if "--- sample (" in ln)
    assert " INFO axonn_launch.train.metrics: done: 2 steps" in lines[-2]
    assert all("gemm" not in ln for ln in lines[sample_at:])  # nothing during the sample

    rank0 = (tmp_path / "jobs" / "default" / "logs" / "rank_0.log").read_text()
    picked = [ln for ln in rank0.splitlines() if "axonn_launch.train.parallel.gemm: gemm " in ln]
    assert picked and all(" DEBUG " in ln and "picked" in ln for ln in picked)  # kept, in the file

    assert lines[-1].startswith("next: "), lines[-1]
    status, report = lines[-1].removeprefix("next: ").split("; ")
    assert shlex.split(status)[1:4] == ["-m", "axonn_launch.jobs", "status"]
    assert shlex.split(report)[1:3] == ["-m", "axonn_launch.report"]
    shown = run_copied(status, tmp_path)
    assert shown.returncode == 0 and "COMPLETED" in shown.stdout, shown.stdout + shown.stderr
    made = run_copied(report, tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    assert (tmp_path / "jobs" / "default" / "report" / "report.md").exists()


def test_a_detached_submission_says_what_is_next(tmp_path, fake_sbatch):
    bindir, marker = fake_sbatch
    proc = run_launcher(["machine=slurm_local", "wait=false", "hydra.run.dir=jobs/detached"],
                        cwd=tmp_path, path_prefix=bindir)  # fmt: skip
    assert proc.returncode == 0 and marker.exists(), proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-3].startswith("submitted job 1 ")
    assert lines[-2].startswith("recovery: job 1 starts if job 1 fails")  # the fake sbatch's id
    assert re.fullmatch(
        r"next: (\S+) -m axonn_launch\.jobs status jobs/detached"
        r"  \(once it ran: \1 -m axonn_launch\.report jobs/detached\)",
        lines[-1],
    ), lines[-1]
    status = lines[-1].removeprefix("next: ").split("  (once it ran: ")[0]
    shown = run_copied(status, tmp_path)  # no sacct here: the row is still listed
    assert shown.returncode == 0 and "jobs/detached" in shown.stdout, shown.stderr


def test_the_starting_line_says_when_python_compiles_first(tmp_path, monkeypatch):
    package = tmp_path / "fresh_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not processes.bytecode_cached(("fresh_pkg",))
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True)
    assert processes.bytecode_cached(("fresh_pkg",))
    assert not processes.bytecode_cached(("no_such_package_here",))
    monkeypatch.setattr(processes, "bytecode_cached", lambda: False)
    assert processes.starting_line(4).endswith("; the first run compiles Python: up to a minute")
    monkeypatch.setattr(processes, "bytecode_cached", lambda: True)
    assert processes.starting_line(4) == (
        "starting 4 ranks (rank 0 logs here, the others to logs/rank_<N>.log)"
    )
