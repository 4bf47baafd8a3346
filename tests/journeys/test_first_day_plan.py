"""``plan`` says what to do next. It explains its columns, says whether
its figures are calibrated, and ends with the launch command of its best row; that last line,
run as printed with ``dry_run=true`` appended, launches the same grid, micro-batch and
weight cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.cli_server import run_module
from tests.conftest import REPO

CALIBRATION = REPO / "bench" / "results" / "calibration-local-4.json"
LEGEND = ("rank", "grid", "mb", "cache", "step s", "% peak", "mem GiB", "compute s", "xy s")


def environment() -> dict[str, str]:
    """This interpreter's folder first on PATH, so the printed ``python`` is this one."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def plan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_module("axonn_launch.plan", list(args), cwd=cwd, env=environment(), timeout=120)


def best_row(text: str) -> tuple[dict[str, int], int, int]:
    """(grid, micro-batch, cache) of the table's rank-1 row."""
    row = next(line.split() for line in text.splitlines() if line.split()[:1] == ["1"])
    data, x, y, z = map(int, row[1].strip("()").split(","))
    return {"data": data, "x": x, "y": y, "z": z}, int(row[2]), int(row[3])


def launch_as_printed(line: str, cwd: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """Run plan's last line through a shell, as a user pasting it would, as a dry run; the
    spec.json of the job dir it wrote."""
    proc = subprocess.run(
        ["bash", "-c", f"{line} dry_run=true"],
        cwd=cwd, env=environment(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    specs = list((cwd / "jobs").glob("*/*/spec.json"))
    assert proc.returncode == 0 and len(specs) == 1, proc.stderr
    return proc, json.loads(specs[0].read_text())


def test_plans_last_line_launches_its_best_grid_with_the_other_overrides(tmp_path):
    proc = plan("machine=frontier", "model=gpt_20b", "nodes=16", "top=3",
                "train.global_batch=256", "name=first day", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    last = lines[-1]
    assert last.startswith("python -m axonn_launch machine=frontier model=gpt_20b grid.data=")
    assert "train.global_batch=256" in last and "'name=first day'" in last  # shell-quoted
    assert "top=" not in last  # plan's own keys are not the launcher's
    assert "site.accounts.frontier" in lines[-2]  # what a real submission still needs
    grid, micro, cache = best_row(proc.stdout)

    launched, spec = launch_as_printed(last, tmp_path)
    assert spec["grid"] == grid and spec["name"] == "first day"
    assert spec["train"]["micro_batch"] == micro and spec["train"]["cache_layers"] == cache
    assert spec["train"]["global_batch"] == 256
    shown = " ".join(f"{axis}={n}" for axis, n in grid.items())
    assert re.search(rf"^grid +{shown} ", launched.stdout, re.M), launched.stdout
    assert re.search(r"^nodes +16 x 8 tasks", launched.stdout, re.M), launched.stdout


def test_plan_explains_its_columns_and_says_the_figures_are_uncalibrated(tmp_path):
    proc = plan("machine=frontier", "model=gpt_320b", "nodes=1024", "top=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    legend = out.split("columns:\n", 1)[1].splitlines()
    explained = [line.split("  ")[1].strip() for line in legend if line.startswith("  ")]
    for column in LEGEND:
        assert column in explained, (column, explained)
    assert "not an MPI rank" in out
    assert any(c.startswith("x/y/z/data s") for c in explained)
    assert "uncalibrated predictions" in out and "python -m axonn_launch.calibrate" in out
    assert "calibration=cal.json" in out


def test_a_calibrated_plan_says_so_and_its_command_launches_the_same_grid(tmp_path):
    proc = plan(f"calibration={CALIBRATION}", "top=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"predictions calibrated with {CALIBRATION}" in proc.stdout
    assert "uncalibrated" not in proc.stdout
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("python -m axonn_launch machine=local model=gpt_tiny grid.data=")
    assert "calibration=" not in last
    grid, micro, cache = best_row(proc.stdout)
    _, spec = launch_as_printed(last, tmp_path)
    assert spec["grid"] == grid and spec["train"]["micro_batch"] == micro
    assert spec["train"]["cache_layers"] == cache


def test_the_json_plan_carries_the_same_launch_command(tmp_path):
    table = plan("machine=perlmutter", "model=gpt_5b", "nodes=2", "top=1", cwd=tmp_path)
    payload = plan("machine=perlmutter", "model=gpt_5b", "nodes=2", "top=1", "output=json",
                   cwd=tmp_path)  # fmt: skip
    assert table.returncode == payload.returncode == 0
    assert json.loads(payload.stdout)["launch_command"] == table.stdout.splitlines()[-1]
