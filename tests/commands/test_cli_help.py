"""Every command and sub-command answers ``--help``: its keys, one line
each, and an example; ``python -m axonn_launch --help`` also names the other commands that
exist in this installation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# listed only when they exist
TOOLS_MAYBE = ("export", "generate", "data", "memorization", "report", "study")


def run_help(*argv: str, cwd: Path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def section(text: str, start: str, end: str) -> list[str]:
    lines = text.splitlines()
    first = lines.index(start) + 1
    last = next(i for i in range(first, len(lines)) if lines[i].startswith(end))
    return [line for line in lines[first:last] if line.strip()]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_plan_help(tmp_path, flag):
    proc = run_help("axonn_launch.plan", flag, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    out = proc.stdout
    assert out.startswith("usage: python -m axonn_launch.plan [KEY=VALUE ...]")
    keys = [line.split()[0] for line in section(out, "keys:", "examples:")]
    assert keys == [
        "machine=NAME", "model=NAME", "nodes=N", "top=K", "output=table|json",
        "calibration=FILE", "queue_wait_h=H", "recovery.spare_nodes=K", "train.KEY=VALUE",
        "machine.hardware.KEY=VALUE", "--config-dir", "--debug",
    ]  # fmt: skip
    examples = out.split("examples:\n", 1)[1].splitlines()
    assert examples and all(e.startswith("  python -m axonn_launch.plan ") for e in examples)
    assert list(tmp_path.iterdir()) == []


def test_calibrate_help_lists_every_setting(tmp_path):
    from axonn_launch.calibrate import Settings

    proc = run_help("axonn_launch.calibrate", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    keys = [line.split()[0].split("=")[0] for line in section(proc.stdout, "keys:", "examples:")]
    settings = [f if f != "output" else "out" for f in Settings.__dataclass_fields__]
    assert keys == [*settings, "--debug"]
    assert "python -m axonn_launch.calibrate machine=local nproc=4" in proc.stdout


@pytest.mark.parametrize(
    "argv,options",
    [
        ((), ["--debug"]),
        (("status",), ["--json", "--debug"]),
        (("resubmit",), ["--dry-run", "--only", "--max-attempts", "--debug"]),
    ],
)
def test_jobs_help(tmp_path, argv, options):
    proc = run_help("axonn_launch.jobs", *argv, "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("usage: python -m axonn_launch.jobs")
    for option in options:
        assert any(line.strip().startswith(option) for line in proc.stdout.splitlines()), option
    examples = proc.stdout.split("examples:\n", 1)[1].splitlines()
    assert examples and all(e.startswith("  python -m axonn_launch.jobs ") for e in examples)


def test_launcher_help_names_the_other_commands(tmp_path):
    proc = run_help("axonn_launch", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    out = proc.stdout
    assert out.startswith("usage: python -m axonn_launch [-m] [KEY=VALUE ...]")
    keys = section(out, "== Keys (one line each; --cfg job prints every key and its value) ==",
                   "== Other commands ==")  # fmt: skip
    for key in ("machine=NAME", "model=NAME", "grid.data/x/y/z=N", "nodes=N", "dry_run=true"):
        assert any(line.split()[0] == key for line in keys), key
    tools = [" ".join(ln.split()[:3]) for ln in section(out, "== Other commands ==", "  (each")]
    present = [t for t in TOOLS_MAYBE if (REPO / "axonn_launch" / f"{t}.py").exists()]
    expected = ["plan", "calibrate", "jobs", *present]
    assert tools == [f"python -m axonn_launch.{t}" for t in expected]
    groups = section(out, "== Configuration groups (group=option) ==", "== Examples ==")
    assert any(g.startswith("machine: ") and "frontier" in g for g in groups)  # Hydra's part
    assert "python -m axonn_launch machine=frontier model=gpt_320b dry_run=true" in out
    assert list(tmp_path.iterdir()) == []


def test_launcher_help_lists_the_machines_of_conf_machine(tmp_path):
    from axonn_launch.config.compose import machine_choices

    proc = run_help("axonn_launch", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("machine=NAME")]
    assert line.split(None, 1)[1] == machine_choices() and "${" not in line
