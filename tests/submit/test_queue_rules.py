"""A site's queue rules, as data in its profile, followed before anything is submitted.

Frontier's time limit follows its scheduling bins (``time_min: auto`` takes the longest
the node count's bin allows); on a QOS where the site forbids chained jobs (NERSC's and
OLCF's debug QOS) no recovery job is chained, with one warning; a sweep whose jobs exceed
the site's per-user queue is warned of before the first point is submitted. Dry runs and
login-node functions only: what is checked is what the batch script and job.json hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axonn_launch.cli import check_arguments
from axonn_launch.common.machine import SlurmSettings
from axonn_launch.config.compose import ConfigError, load
from axonn_launch.config.resolve import check_time_limit
from axonn_launch.submit import chain
from tests.conftest import run_launcher

FRONTIER = ["machine=frontier", "model=gpt_tiny", "site.accounts.frontier=abc"]
PERLMUTTER = ["machine=perlmutter", "model=gpt_tiny", "site.accounts.perlmutter=m1_g"]
BINS = [[91, 120], [183, 360], [9472, 720]]  # OLCF's bins, as conf/machine/frontier.yaml


@pytest.mark.parametrize(
    ("nodes", "minutes"),
    [(1, 120), (91, 120), (92, 360), (183, 360), (184, 720), (9472, 720), (9856, 720)],
)
def test_auto_takes_the_longest_limit_of_the_node_counts_bin(nodes, minutes):
    assert SlurmSettings(time_min=None, time_bins=BINS).limit_min(nodes) == minutes
    assert SlurmSettings(time_min=45, time_bins=BINS).limit_min(nodes) == 45  # given: kept


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (SlurmSettings(time_min=None), "machine.slurm.time_min=auto"),
        (SlurmSettings(time_bins=[[91, 120], [50, 360]]), "machine.slurm.time_bins[1]"),
        (SlurmSettings(time_bins=[[91]]), "machine.slurm.time_bins[0]"),
        (SlurmSettings(time_min=0), "machine.slurm.time_min=0"),
    ],
)
def test_a_time_limit_that_cannot_be_worked_out_is_one_line_naming_the_key(settings, named):
    with pytest.raises(ConfigError, match=r"^" + named.replace("[", r"\[")):
        check_time_limit(settings)


def script_and_record(args: list[str], tmp_path: Path, name: str) -> tuple[str, dict, str]:
    job = tmp_path / name
    proc = run_launcher([*args, "dry_run=true", f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((job / "job.json").read_text())
    return (job / "submission.sh").read_text(), record, proc.stdout + proc.stderr


def test_frontier_at_1024_nodes_asks_for_its_bins_twelve_hours(tmp_path):
    big = [*FRONTIER, "model=gpt_80b", "nodes=1024", "grid=auto"]
    script, _, out = script_and_record(big, tmp_path, "big")
    assert "#SBATCH --time=720" in script
    assert "720 min (machine.slurm.time_min=auto: the site's longest for up to 9472 nodes)" in out
    script, _, _ = script_and_record([*big, "machine.slurm.time_min=240"], tmp_path, "given")
    assert "#SBATCH --time=240" in script


def test_a_debug_qos_gets_no_recovery_chain_and_one_warning(tmp_path):
    grid = ["grid.x=2", "grid.z=2"]
    _, regular, out = script_and_record([*PERLMUTTER, *grid], tmp_path, "regular")
    assert regular["recovery"] and "chained jobs" not in out
    args = [*PERLMUTTER, *grid, "machine.slurm.qos=debug"]
    _, debug, out = script_and_record(args, tmp_path, "debug")
    assert "recovery" not in debug
    (line,) = [ln for ln in out.splitlines() if "forbids chained jobs" in ln]
    assert line.startswith("warning: perlmutter forbids chained jobs on debug")
    assert "https://docs.nersc.gov/jobs/policy/" in line


def test_a_sweep_past_the_sites_queue_is_warned_of_before_anything_runs(capsys):
    """The argument check that runs before Hydra composes every point, so the limit is
    lowered here to keep the sweep small: 3 points, each a job and its recovery job, are
    over 5 queued jobs; 2 points are not. Frontier's own limit is OLCF's 100."""
    assert load(FRONTIER).machine.slurm.max_queued_jobs == 100
    args = ["-m", *FRONTIER, "grid.x=2", "grid.z=4", "machine.slurm.max_queued_jobs=5"]
    check_arguments([*args, "train.seed=1,2,3", "dry_run=true"])
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "queued jobs" in ln]
    assert line.startswith("warning: 3 points x a job and its recovery job = 6 queued jobs")
    assert "machine.slurm.max_queued_jobs=5" in line and "frontier_user_guide" in line
    check_arguments([*args, "train.seed=1,2", "dry_run=true"])
    assert "queued jobs" not in capsys.readouterr().err


def test_without_a_chain_each_point_is_one_job():
    cfg = load([*FRONTIER, "grid.x=2", "grid.z=4", "recovery=off"])
    assert chain.sweep_queue_warnings(cfg, 100) == []
    assert chain.sweep_queue_warnings(cfg, 101)[0].startswith("101 points x a job = 101")
