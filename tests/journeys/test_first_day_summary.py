"""The launch summary, through the command a user types: it shows the
account, the time limit, the predicted step time and time to finish with the allocations it
takes, and warns (still launching) when the run cannot finish in ``time_min x (1 +
max_requeue)``; it says where the node count came from and the memory headroom. The
predictions are checked against ``plan output=json``, the planner's own answer."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest

from tests.cli_server import run_module
from tests.conftest import REPO, run_launcher

LLAMA = ["machine=perlmutter", "model=llama3_70b", "site.accounts.perlmutter=m1_g",
         "train.data=synthetic"]  # fmt: skip
WARNING = "warning: the run cannot finish in its allocations: "


def dry_run(args: list[str], tmp_path, name: str = "job") -> subprocess.CompletedProcess:
    proc = run_launcher([*args, "dry_run=true", f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return proc


def field(stdout: str, label: str) -> str:
    """The value of one summary line (the label, padded to 10, then a space)."""
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith(f"{label:<10} ")]
    return line[11:]


def planner(args: list[str], tmp_path) -> dict:
    proc = run_module("axonn_launch.plan", [*args, "output=json", "top=1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def largest_term(plan: dict) -> str:
    """The largest memory term of the plan's first row, as the memory model counts it."""
    from axonn_launch.common.grid import Grid
    from axonn_launch.config.compose import load
    from axonn_launch.cost.memory import estimate_memory

    row, cfg = plan["plans"][0], load(LLAMA[:2])
    train = dataclasses.replace(cfg.train, micro_batch=row["micro_batch"],
                                cache_layers=row["cache_layers"])  # fmt: skip
    return estimate_memory(model=cfg.model, grid=Grid(**row["grid"]), train=train).biggest()[0]


def predicted(stdout: str, hardware: str = r"\w+'s \S+") -> tuple[float, int, int]:
    """(seconds per step, steps, allocations) from the ``predicted`` line, which names the
    hardware it assumes (``perlmutter's A100-SXM4-40GB``)."""
    text = field(stdout, "predicted")
    m = re.fullmatch(
        rf"([\d.]+) s/step on {hardware} \(planner, uncalibrated\) x ([\d,]+) steps ="
        r" [\d.]+ (?:s|min|h|days): ([\d,]+) allocations?(?:, [\d,]+ requeues?)?",
        text,
    )
    assert m, text
    return float(m[1]), int(m[2].replace(",", "")), int(m[3].replace(",", ""))


def test_a_run_that_cannot_finish_in_its_allocations_is_warned_and_still_launches(tmp_path):
    proc = dry_run(LLAMA, tmp_path)
    best = planner(LLAMA[:2], tmp_path)["plans"][0]
    assert field(proc.stdout, "account") == "m1_g"
    assert field(proc.stdout, "time limit") == (
        "120 min (machine.slurm.time_min) x 4 allocations (1 + max_requeue=3) = 8.0 h"
    )
    step_s, steps, allocations = predicted(proc.stdout, "perlmutter's A100-SXM4-40GB")
    assert step_s == pytest.approx(best["step_time_s"], rel=1e-3)  # the planner's number
    assert steps == 10_000  # llama3_70b's preset
    assert allocations == math.ceil(best["step_time_s"] * steps / 7200)
    # "about 31 days" was the fastest grid at 92% of GPU memory; the grid with 10% headroom
    days = best["step_time_s"] * steps / 86400
    assert f" = {days:.1f} days: " in field(proc.stdout, "predicted") and 35 < days < 45

    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith(WARNING)]
    assert len(warnings) == 1, proc.stderr
    for key in ("machine.slurm.time_min=", "max_requeue=", "train.steps=", "nodes="):
        assert key in warnings[0], key
    assert (tmp_path / "job" / "submission.sh").exists()  # the launch went on

    # the advice works: each suggested value, applied alone, silences the warning
    suggested = dict(re.findall(r"(max_requeue|machine\.slurm\.time_min|train\.steps)=(\d+)",
                                warnings[0].split("; set ", 1)[1]))  # fmt: skip
    assert set(suggested) == {"max_requeue", "machine.slurm.time_min", "train.steps"}
    for key, value in suggested.items():
        fixed = dry_run([*LLAMA, f"{key}={value}"], tmp_path, name=key)
        assert WARNING not in fixed.stderr, (key, value, fixed.stderr)
    one_more = dry_run([*LLAMA, f"train.steps={int(suggested['train.steps']) + 1}"], tmp_path,
                       name="one_more")  # fmt: skip
    assert WARNING in one_more.stderr  # the suggestion is the largest that fits


def test_a_run_that_fits_gets_no_warning_and_the_budget_follows_the_keys(tmp_path):
    args = [*LLAMA, "train.steps=40"]  # 40 x ~330 s = ~3.7 h: 2 allocations of 2 h
    fits = dry_run(args, tmp_path, name="fits")
    assert WARNING not in fits.stderr
    assert predicted(fits.stdout)[2] == 2
    assert field(fits.stdout, "predicted").endswith(": 2 allocations, 1 requeue")
    strict = dry_run([*args, "max_requeue=0"], tmp_path, name="strict")  # 2 h in all
    assert field(strict.stdout, "time limit").endswith("x 1 allocation (1 + max_requeue=0) = 2.0 h")
    assert WARNING in strict.stderr
    longer = dry_run([*args, "max_requeue=0", "machine.slurm.time_min=240"], tmp_path, name="long")
    assert WARNING not in longer.stderr
    assert field(longer.stdout, "time limit").startswith("240 min (machine.slurm.time_min)")
    assert "#SBATCH --time=240" in (tmp_path / "long" / "submission.sh").read_text()


def test_frontier_gpt_320b_names_its_fifty_hours(tmp_path):
    args = ["machine=frontier", "model=gpt_320b", "train.data=synthetic"]
    proc = dry_run(args, tmp_path)
    assert field(proc.stdout, "account").startswith("<REQUIRED:machine.slurm.account>")
    step_s, steps, _ = predicted(proc.stdout)
    assert step_s == pytest.approx(planner(args, tmp_path)["plans"][0]["step_time_s"], rel=1e-3)
    hours = f"{step_s * steps / 3600:.1f} h"  # 1,000 steps x 179 s = about 50 h
    assert steps == 1000 and f" = {hours}: " in field(proc.stdout, "predicted")
    assert sum(ln.startswith(WARNING) for ln in proc.stderr.splitlines()) == 1


def test_the_summary_says_where_the_node_count_came_from_and_the_memory_headroom(tmp_path):
    planned = dry_run(LLAMA, tmp_path, name="planned")
    plan = planner(LLAMA[:2], tmp_path)
    assert plan["nodes_given"] is False  # plan, too, searched for the fewest
    assert field(planned.stdout, "nodes") == (
        f"{plan['nodes']} x 4 tasks: the fewest where a grid fits (planner)"
    )
    gib = plan["plans"][0]["memory_gib"]
    assert field(planned.stdout, "memory") == (
        f"{gib:.1f} of 40 GiB per GPU ({gib / 40:.0%}, largest: {largest_term(plan)})"
    )
    given = dry_run([*LLAMA, "nodes=32"], tmp_path, name="given")
    assert field(given.stdout, "nodes") == "32 x 4 tasks: given (nodes=32)"
    explicit = dry_run([*LLAMA, "grid.x=2", "grid.y=2", "grid.z=16", "train.steps=10"],
                       tmp_path, name="explicit")  # fmt: skip
    assert field(explicit.stdout, "nodes") == "16 x 4 tasks: from the grid (64 ranks / 4 per node)"


def test_this_computer_has_no_account_and_no_time_limit(tmp_path):
    proc = dry_run(["machine=local"], tmp_path)
    assert field(proc.stdout, "nodes") == "1 x 4 tasks: this computer"
    assert re.fullmatch(r"\d+\.\d\d GiB per rank \(largest: .+\)", field(proc.stdout, "memory"))
    for label in ("account", "time limit", "predicted"):
        assert not any(ln.startswith(f"{label:<10} ") for ln in proc.stdout.splitlines())
    assert "warning:" not in proc.stderr


def test_the_launcher_help_and_the_readme_name_the_time_limit(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "axonn_launch", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    keys = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.startswith("  ")]
    assert "machine.slurm.time_min=MIN" in keys and "max_requeue=N" in keys
    table = [ln for ln in (REPO / "README.md").read_text().splitlines() if ln.startswith("| `")]
    assert any(ln.startswith("| `machine.slurm.time_min=` |") for ln in table)
