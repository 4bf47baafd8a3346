"""What the launcher must neither pass over in silence nor say wrongly on a
new user's first day. Each case through the command a user types (dry runs: nothing is
submitted)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, run_launcher


def warnings_of(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("warning:")]


def test_an_x_axis_spanning_nodes_warns_in_one_line_and_still_launches(tmp_path):
    args = ["machine=frontier", "model=gpt_320b", "grid.z=64", "dry_run=true"]
    proc = run_launcher([*args, "grid.x=16"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    spans = [w for w in warnings_of(proc) if "grid.x=16" in w]
    assert len(spans) == 1, proc.stderr
    assert "does not divide the 8 GPUs of a node" in spans[0] and "slower" in spans[0]
    assert "grid       data=1 x=16 y=1 z=64" in proc.stdout  # launched as asked
    inside = run_launcher([*args, "grid.x=8", "grid.data=2"], cwd=tmp_path)
    assert inside.returncode == 0, inside.stderr
    assert not [w for w in warnings_of(inside) if "grid.x=" in w], inside.stderr


def test_a_perlmutter_account_without_the_gpu_suffix_warns(tmp_path):
    args = ["machine=perlmutter", "model=gpt_5b", "grid.x=4", "grid.z=8", "dry_run=true"]
    proc = run_launcher([*args, "site.accounts.perlmutter=m1234"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    suffix = [w for w in warnings_of(proc) if "account" in w]
    assert len(suffix) == 1 and "'_g'" in suffix[0] and "did you mean 'm1234_g'" in suffix[0]
    right = run_launcher([*args, "site.accounts.perlmutter=m1234_g"], cwd=tmp_path)
    assert right.returncode == 0 and not [w for w in warnings_of(right) if "account" in w]


@pytest.mark.parametrize(
    "machine, grid, gpu",
    [("perlmutter", ["grid.x=4", "grid.z=8"], "an A100-SXM4-40GB"),
     ("frontier", ["grid.x=8", "grid.z=8"], "an MI250X-GCD")],
)  # fmt: skip
def test_the_too_big_message_reads_right_and_suggests_only_what_is_not_set(
    tmp_path, machine, grid, gpu
):
    args = [f"machine={machine}", "model=gpt_320b", *grid, "dry_run=true"]
    on = run_launcher([*args, "train.activation_checkpointing=true"], cwd=tmp_path)
    assert on.returncode == 2 and len(on.stderr.splitlines()) == 1, on.stderr
    assert f"but {gpu} has" in on.stderr
    assert "activation_checkpointing" not in on.stderr  # already on
    assert "smaller train.micro_batch" not in on.stderr  # the automatic one tried them all
    off = run_launcher([*args, "train.activation_checkpointing=false"], cwd=tmp_path)
    assert off.returncode == 2 and "train.activation_checkpointing=true" in off.stderr
    pinned = run_launcher([*args, "train.micro_batch=16"], cwd=tmp_path)
    assert pinned.returncode == 2 and "a smaller train.micro_batch (valid: 8)" in pinned.stderr
    assert not (tmp_path / "jobs").exists()  # nothing written


@pytest.mark.parametrize("tool", ["memorization", "study"])
def test_the_goldfish_help_cites_the_papers_not_a_file_outside_the_repository(tmp_path, tool):
    proc = subprocess.run(
        [sys.executable, "-m", f"axonn_launch.{tool}", "--help"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith(f"usage: python -m axonn_launch.{tool}")
    assert "keys:" in proc.stdout and "examples:" in proc.stdout  # the common help layout
    assert "axonn.md" not in proc.stdout
    assert "arXiv 2406.10209" in proc.stdout


def test_the_readme_cites_no_file_outside_the_repository():
    readme = (REPO / "README.md").read_text()
    assert "axonn.md" not in readme
    assert "arXiv 2406.10209" in readme
