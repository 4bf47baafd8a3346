"""A dry run prints the summary and the batch script, at most 80 lines in all (a
Perlmutter gpt_80b dry run printed about 300, 90 of them the profile's ``sources:``
map); ``show_config=true`` adds the resolved config with that map, as the job dir keeps it."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_launcher

SITE = ["machine=perlmutter", "model=gpt_80b", "dry_run=true"]
CONFIG_HEAD = "--- resolved config (with machine.sources) ---\n"


def dry_run(tmp_path: Path, name: str, *extra: str):
    proc = run_launcher([*SITE, *extra, f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return proc, (tmp_path / name / "config.yaml").read_text()


def test_a_site_dry_run_prints_the_summary_and_the_script_in_80_lines(tmp_path):
    proc, saved = dry_run(tmp_path, "short")
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) <= 80, len(lines)
    out = proc.stdout
    assert out.startswith("job        gpt_80b-perlmutter\n")
    assert "\n--- batch script ---\n#!/bin/bash\n" in out and "#SBATCH --nodes=8\n" in out
    # the whole script: its srun line in the loop of the restarts in place, to its end
    assert out.rstrip().endswith("; done") and "\nsrun " in out
    assert "sources:" not in out and CONFIG_HEAD not in out
    assert "config     the job dir's config.yaml (show_config=true prints it" in out
    assert "\n  sources:\n" in saved  # the job dir keeps the whole resolved config
    assert "warning: memory: 39.9 of 40 GiB per GPU (100%) is above 90%" in proc.stderr


def test_show_config_prints_the_resolved_config_with_its_sources(tmp_path):
    proc, saved = dry_run(tmp_path, "full", "show_config=true")
    shown = proc.stdout.split(CONFIG_HEAD, 1)[1].split("\n--- batch script ---\n")[0]
    assert shown == saved.rstrip("\n")
    assert "\n  sources:\n" in shown and "    multinode_env.NCCL_PROTO: " in shown
    assert len(proc.stdout.splitlines()) > 250
