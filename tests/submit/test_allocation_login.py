"""allocation=auto|new on a login node, no Slurm needed: a dry run with the variables
``salloc`` sets (SLURM_JOB_ID, SLURM_JOB_NUM_NODES) in its environment. The real step in a
real ``salloc``: tests/slurm/test_held_allocation.py."""

from __future__ import annotations

import json

from tests.conftest import run_launcher

SLURM_X2Z2 = ["machine=slurm_local", "grid.x=2", "grid.z=2", "dry_run=true"]  # 2 nodes x 2 tasks


def held(nodes: int) -> dict[str, str]:
    """The environment of a shell inside ``salloc -N <nodes>``, as far as the launch reads it."""
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes)}


def test_a_grid_larger_than_the_allocation_is_one_line_and_writes_nothing(tmp_path):
    job_dir = tmp_path / "job"
    done = run_launcher([*SLURM_X2Z2, f"hydra.run.dir={job_dir}"], cwd=tmp_path, env=held(1))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: allocation=auto: the grid needs 2 nodes"), lines[0]
    assert "Slurm job 4242 holds 1" in lines[0] and "allocation=new" in lines[0]
    assert not job_dir.exists()


def test_a_fitting_grid_runs_as_a_step_and_allocation_new_ignores_the_allocation(tmp_path):
    step, new = tmp_path / "step", tmp_path / "new"
    inside = run_launcher([*SLURM_X2Z2, f"hydra.run.dir={step}"], cwd=tmp_path, env=held(2))
    assert inside.returncode == 0, inside.stderr
    assert "allocation: running as a step of Slurm job 4242 (2 of its 2 nodes" in inside.stdout
    assert "recovery" not in json.loads((step / "job.json").read_text())  # never chained

    args = [*SLURM_X2Z2, "allocation=new", f"hydra.run.dir={new}"]
    outside = run_launcher(args, cwd=tmp_path, env=held(1))  # too small, but not used
    assert outside.returncode == 0, outside.stderr
    assert "allocation:" not in outside.stdout
    record = json.loads((new / "job.json").read_text())
    assert "in_allocation" not in record and record["recovery"]["mode"] == "auto"


def test_a_bad_allocation_value_is_one_line(tmp_path):
    done = run_launcher(["allocation=maybe", f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: allocation='maybe': valid: auto, new"
    assert not (tmp_path / "job").exists()


def test_a_resubmission_from_inside_a_job_submits_a_new_job(
    tmp_path, monkeypatch, capsys, fake_sbatch
):
    """What a recovery job does (``jobs resubmit`` from inside its own allocation): sbatch,
    never a step of that allocation."""
    from axonn_launch import jobs
    from tests.records.test_failures import KILLED, SACCT, fake_tools, make_job

    root = tmp_path / "jobs"
    make_job(root, "killed", "104", logs={0: KILLED}, steps_done=7)
    bindir, marker = fake_sbatch
    tools = fake_tools(tmp_path, sacct=SACCT)["PATH"]
    monkeypatch.setenv("PATH", f"{bindir}:{tools}")
    for key, value in held(2).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    assert jobs.main(["resubmit", str(root), "--only", "rank_killed"]) == 0
    calls = marker.read_text().splitlines()
    assert any("sbatch" in c and "recovery.sh" not in c for c in calls), calls
    record = json.loads((root / "killed_attempt2" / "job.json").read_text())
    assert record["job_ids"] == ["1"] and "in_allocation" not in record
    assert "allocation:" not in capsys.readouterr().out
