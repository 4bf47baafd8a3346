"""A dry run is its own state in ``jobs status``, ``report`` and
``generate``, not a failure: status shows DRY_RUN with no failure class; report and
generate say in one line that nothing was trained (exit code 2, nothing written)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_launcher

DRY_RUN_LINE = "is a dry run: nothing was trained; launch it without dry_run=true"


def run(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("dry")
    made = run_launcher(["dry_run=true", f"hydra.run.dir={cwd / 'job'}"], cwd=cwd)
    assert made.returncode == 0, made.stderr
    return cwd / "job"


def test_status_shows_a_dry_run_state_without_failure_class(dry_run):
    table = run("axonn_launch.jobs", "status", str(dry_run), cwd=dry_run.parent)
    assert table.returncode == 0, table.stderr
    header, row, *notes = table.stdout.splitlines()
    cells = dict(zip(header.replace("JOB ID", "JOB_ID").split(), row.split()))
    assert (cells["STATE"], cells["CLASS"]) == ("DRY_RUN", "-"), table.stdout
    assert notes == []  # no "why it failed" line
    shown = run("axonn_launch.jobs", "status", "--json", str(dry_run), cwd=dry_run.parent)
    (record,) = json.loads(shown.stdout)
    assert (record["state"], record["failure"], record["action"]) == ("DRY_RUN", "", "")
    again = run("axonn_launch.jobs", "resubmit", "--dry-run", str(dry_run), cwd=dry_run.parent)
    assert again.returncode == 0 and "a dry run: nothing to resubmit" in again.stdout


@pytest.mark.parametrize(
    "tool, args",
    [
        ("axonn_launch.report", []),
        ("axonn_launch.generate", ["prompts={prompts}", "out={out}"]),
    ],
)
def test_report_and_generate_say_it_is_a_dry_run(dry_run, tmp_path, tool, args):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "ROMEO:"}\n')
    argv = [a.format(prompts=prompts, out=tmp_path / "o.jsonl") for a in args]
    before = sorted(p.name for p in dry_run.parent.iterdir())
    proc = run(tool, str(dry_run), *argv, cwd=dry_run.parent)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"error: {dry_run}: {DRY_RUN_LINE}\n"
    assert not (dry_run / "report").exists() and not (tmp_path / "o.jsonl").exists()
    assert sorted(p.name for p in dry_run.parent.iterdir()) == before  # no generate job dir


def test_report_on_a_dry_run_sweep(tmp_path):
    made = run_launcher(["-m", "grid.x=1,2", "dry_run=true"], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    (sweep,) = (tmp_path / "jobs" / "sweeps").iterdir()
    proc = run("axonn_launch.report", str(sweep), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == f"error: {sweep}: {DRY_RUN_LINE}\n"
