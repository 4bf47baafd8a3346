"""A machine profile is checked when it is loaded (common/machine.py required_problem,
kind_problem; config/compose.py check_profile): each mistake of a site's profile, kept in its
own config dir (--config-dir), is one line naming the file and the key, exit code 2, nothing
written. With the frictions of a new site's first day (issue 47)."""

from __future__ import annotations

import re

import pytest

from axonn_launch.common.spec import TrainConfig
from axonn_launch.config.resolve import warmup_warnings
from axonn_launch.jobs import short_grid
from axonn_launch.submit.summary import goldfish_lines
from tests.cli_server import run_module
from tests.conftest import REPO, run_launcher

FRONTIER = (REPO / "axonn_launch" / "conf" / "machine" / "frontier.yaml").read_text()
GPUS = "  gpus_per_node: 8\n"  # hardware.gpus_per_node (slurm.gpus_per_node is indented alike)
assert FRONTIER.count(GPUS) == 1

# (how the profile is broken, text the one line must hold after the file's name)
MISTAKES = [
    (lambda t: t.replace(GPUS, ""), "machine.hardware.gpus_per_node: missing; a Slurm machine"),
    (lambda t: re.sub(r"\n  mem_per_gpu_gb:[^\n]*", "", t), "machine.hardware.mem_per_gpu_gb"),
    (lambda t: t.replace("\nscheduler: slurm", ""), "machine.scheduler: missing"),
    (lambda t: t.replace("\nname: newsite", ""), "machine.name: missing"),
    (lambda t: re.sub(r"\n  partition:[^\n]*", "", t), "machine.slurm.partition: missing"),
    (lambda t: re.sub(r"\n  peak_tflops_per_gpu:[^\n]*", "", t),
     "machine.hardware.peak_tflops_per_gpu: missing; a Slurm machine"),
    (lambda t: t.replace(GPUS, "  gpus_per_nod: 8\n"),
     "machine.hardware.gpus_per_nod: unknown key; did you mean machine.hardware.gpus_per_node?"),
    (lambda t: t.replace(GPUS, "  gpus_per_node: eight\n"),
     "machine.hardware.gpus_per_node='eight': expected an integer"),
]  # fmt: skip


def site_dir(tmp_path, text: str):
    site = tmp_path / "site"
    (site / "machine").mkdir(parents=True)
    (site / "machine" / "newsite.yaml").write_text(text)
    return site


def newsite(text: str = FRONTIER) -> str:
    return text.replace("name: frontier", "name: newsite").replace(
        "accounts.frontier", "accounts.newsite"
    )


@pytest.mark.parametrize("breaks,expected", MISTAKES, ids=[e.split(":")[0] for _, e in MISTAKES])
def test_a_profile_mistake_is_one_line_naming_file_and_key(breaks, expected, tmp_path):
    site = site_dir(tmp_path, breaks(newsite()))
    work = tmp_path / "cwd"
    work.mkdir()
    result = run_launcher(["--config-dir", str(site), "machine=newsite", "dry_run=true"], cwd=work)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr + result.stdout
    assert lines[0].startswith(f"error: {site / 'machine' / 'newsite.yaml'}: {expected}"), lines[0]
    assert "Traceback" not in result.stderr + result.stdout and list(work.iterdir()) == []


def test_a_new_site_is_told_how_to_add_a_machine_and_its_account(tmp_path):
    unknown = run_launcher(["machine=newsite"], cwd=tmp_path)
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert (
        "valid: alps, frontier, local, lumi, perlmutter, slurm_local; to add one, write"
        in unknown.stderr
    )
    assert "DIR/machine/newsite.yaml" in unknown.stderr
    assert "--config-dir DIR" in unknown.stderr and list(tmp_path.iterdir()) == []
    site = site_dir(tmp_path, newsite())
    work = tmp_path / "cwd"
    work.mkdir()
    dry = run_launcher(["--config-dir", str(site), "machine=newsite", "dry_run=true"], cwd=work)
    assert dry.returncode == 0, dry.stderr
    assert "or +site.accounts.newsite=..." in dry.stderr  # a new key needs Hydra's +
    plan = run_module("axonn_launch.plan", [f"hydra.searchpath=[file://{site}]", "machine=newsite"],
                      cwd=work)  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert "(+site.accounts.newsite=...):" in plan.stdout.splitlines()[-2]
    known = run_module("axonn_launch.plan", ["machine=frontier"], cwd=work)
    assert "(site.accounts.frontier=...):" in known.stdout.splitlines()[-2]


def test_a_list_without_multirun_is_told_to_add_m(tmp_path):
    result = run_launcher(["grid.x=1,2"], cwd=tmp_path)
    assert result.returncode == 2 and list(tmp_path.iterdir()) == []
    assert result.stderr.startswith("error: grid.x=1,2: a list of values runs a sweep; add -m")


def test_resume_of_a_new_dir_points_to_the_old_one(tmp_path):
    result = run_launcher(["resume=true", "dry_run=true"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "holds no run to continue" in result.stderr
    assert "hydra.run.dir=<old dir> resume=true" in result.stderr
    assert "jobs resubmit <old dir>" in result.stderr


def test_a_warmup_longer_than_the_run_is_warned():
    (line,) = warmup_warnings(TrainConfig(steps=40, warmup_steps=100))
    assert line.startswith("train.warmup_steps=100 >= the run's 40 steps") and "=4" in line
    assert warmup_warnings(TrainConfig(steps=200, warmup_steps=100)) == []


def test_the_summary_says_when_the_goldfish_loss_is_on():
    train = TrainConfig()
    assert goldfish_lines(train) == []
    on = TrainConfig(goldfish=type(train.goldfish)(k=4))
    (line,) = goldfish_lines(on)
    assert line.startswith("loss       Goldfish: about 1 label in 4") and "h=4" in line


def test_status_shows_a_one_rank_grid_as_the_others():
    assert short_grid("data=1 x=1 y=1 z=1") == "x1"
    assert short_grid("data=2 x=2 y=1 z=1") == "d2x2"
