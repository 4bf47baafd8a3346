"""Repeating and extending, on this computer: a launch identical to a detached
local run that is still going is refused in one line (``submit/duplicates.py``); that run,
once completed at step N, is extended to step 2N by ``jobs resubmit <dir> train.steps=2N``
from its checkpoint at N, with the learning rate the stated rule gives (warmup + cosine,
restarted at N: ``train/loop.learning_rate``), read from metrics.jsonl; and a dry run's
``jobs status`` row says so instead of running. One real 1-rank gpt_tiny run of 4 steps
and its extension, shared by the module."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import read_record, read_summary
from axonn_launch.scheduler import processes
from axonn_launch.submit import duplicates
from tests.cli_server import run_module
from tests.conftest import REPO, run_launcher
from tests.submit.test_local_supervisor import poll

N, WARMUP, LR, MIN_LR = 4, 2, 3e-3, 3e-4
RUN = ["machine=local", "model=gpt_tiny", "grid.x=1", "grid.z=1", f"train.steps={N}",
       f"train.warmup_steps={WARMUP}", f"train.lr={LR}", f"train.min_lr={MIN_LR}",
       "train.sample_tokens=0", "train.progress=false", "train.gemm_tuning=false",
       "train.eval_batches=0"]  # fmt: skip
RUN_ENDS_S = 240
pytestmark = pytest.mark.slow


def jobs(*args: str):
    return run_module("axonn_launch.jobs", list(args), cwd=REPO, timeout=RUN_ENDS_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """A detached run of N steps, an identical launch beside it while it runs, then its
    extension to 2N (followed to its end: ``wait=true``)."""
    root = tmp_path_factory.mktemp("extend")
    first, second = root / "runs" / "first", root / "runs" / "second"
    detached = run_launcher([*RUN, "wait=false", f"hydra.run.dir={first}"], cwd=REPO)
    assert detached.returncode == 0, detached.stderr[-2000:]
    again = run_launcher([*RUN, "wait=false", f"hydra.run.dir={second}"], cwd=REPO)
    live = processes.live_supervisors([first])  # the first run still going after the second
    poll(lambda: read_record(first).get("status") != "running", RUN_ENDS_S, "run 1 ended")
    assert read_record(first)["status"] == "completed", (first / "axonn_launch.log").read_text()
    poll(lambda: not processes.live_supervisors([first]), 30, "its supervisor ended")
    extended = jobs("resubmit", str(first), f"train.steps={2 * N}", "wait=true")
    return {"root": root, "first": first, "second": second, "again": again, "live": live,
            "extended": extended, "extension": root / "runs" / "first_attempt2"}  # fmt: skip


def test_an_identical_launch_beside_a_running_one_is_refused_in_one_line(runs):
    again, first = runs["again"], runs["first"]
    assert runs["live"], "the first run ended before the second launch: nothing was tested"
    job_id = read_record(first)["job_ids"][0]
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert again.stderr.splitlines() == [
        f"error: job {job_id} (RUNNING) in {first} has the same config and is not over:"
        f" nothing submitted; follow it with python -m axonn_launch.jobs status {first},"
        " or add force=true to launch another"
    ]
    assert not (runs["second"] / "job.json").exists()


def test_the_extension_reaches_2n_from_the_checkpoint_at_n(runs):
    proc, extension = runs["extended"], runs["extension"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    job_id = read_record(runs["first"])["job_ids"][0]
    assert f"extended {job_id} (completed) as job local-" in proc.stdout
    assert f"resumes from step {N} (checkpoints/step_{N:08d})" in proc.stdout
    assert f"the learning rate restarts at step {N}" in proc.stdout
    summary = read_summary(extension)
    assert (summary["steps"], summary["resumed_from"]) == (2 * N, N)
    record = read_record(extension)
    assert (record["status"], record["attempt"], record["steps"]) == ("completed", 2, 2 * N)
    assert f"train.schedule_start={N}" in record["command_line"]
    assert [row["step"] for row in metrics(extension)] == list(range(1, 2 * N + 1))


def restarted_rule(step: int, start: int, steps: int) -> float:
    """The stated rule for the 1-based ``step`` of a run whose schedule starts after step
    ``start``: linear warmup over WARMUP steps, then a cosine from LR to MIN_LR at
    ``steps``, both counted from ``start``."""
    k = step - 1 - start
    if k < WARMUP:
        return LR * (k + 1) / WARMUP
    progress = min(1.0, (k - WARMUP) / max(1, steps - start - WARMUP))
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * progress))


def test_the_extension_restarts_warmup_and_cosine_at_n(runs):
    rows = {row["step"]: row["lr"] for row in metrics(runs["extension"])}
    first = [rows[s] for s in range(1, N + 1)]
    extended = [rows[s] for s in range(N + 1, 2 * N + 1)]
    assert first == pytest.approx([restarted_rule(s, 0, N) for s in range(1, N + 1)], rel=1e-9)
    expected = [restarted_rule(s, N, 2 * N) for s in range(N + 1, 2 * N + 1)]
    assert extended == pytest.approx(expected, rel=1e-9)
    assert extended[0] == pytest.approx(LR / WARMUP)  # warmup again, not min_lr or mid-cosine
    assert extended[-1] < extended[1]  # and a cosine down again to the end


def test_resubmit_of_a_completed_job_says_how_to_extend_it(runs):
    extension, root = runs["extension"], runs["root"]
    job_id = read_record(extension)["job_ids"][0]
    asked = jobs("resubmit", str(extension), "--only", "completed")
    short = jobs("resubmit", str(extension), f"train.steps={2 * N}")
    planned = jobs("resubmit", str(extension), f"train.steps={3 * N}", "--dry-run")
    tree = jobs("resubmit", str(root / "runs"), f"train.steps={3 * N}", "--dry-run")
    assert asked.stdout.splitlines() == [
        f"skip  {job_id} {extension}: completed: nothing to do without train.steps=N"
        f" (N > {2 * N} extends it)"
    ]
    assert short.stdout.splitlines() == [
        f"skip  {job_id} {extension}: train.steps={2 * N}: completed at step {2 * N};"
        f" give N > {2 * N} to extend it"
    ]
    head = planned.stdout.splitlines()[0]
    assert head.startswith(f"would extend {job_id} (completed) as {root}/runs/first_attempt3:")
    assert f"train.steps={3 * N} train.schedule_start={2 * N}" in head
    assert not (root / "runs" / "first_attempt3").exists()
    assert tree.stdout.splitlines()[-1] == (  # train.steps for a tree's failed jobs only
        f"skip  {job_id} {extension}: completed: nothing to do (name its dir, or --only"
        " completed, to extend it)"
    )


def test_a_dry_run_is_no_running_run_in_jobs_status(tmp_path):
    where = tmp_path / "jobs"
    dry = run_launcher(
        ["machine=slurm_local", "dry_run=true", f"hydra.run.dir={where / 'dry'}"], cwd=REPO
    )
    assert dry.returncode == 0, dry.stderr[-2000:]
    table = jobs("status", str(where)).stdout.splitlines()
    run_cell = table[1][table[0].index(" RUN ") + 1 :].split("  ")[0]
    assert run_cell == "dry run", table  # was "running"
    (shown,) = json.loads(jobs("status", "--json", str(where)).stdout)
    assert (shown["state"], shown["run_state"]) == ("DRY_RUN", "dry run")


def test_the_config_hash_leaves_out_only_what_does_not_change_the_run():
    base = {"name": "a", "wait": True, "dry_run": False, "force": False, "train": {"steps": 4}}
    renamed = {**base, "name": "b", "wait": False, "force": True}
    assert duplicates.config_hash(renamed) == duplicates.config_hash(base)
    assert duplicates.config_hash({**base, "train": {"steps": 5}}) != duplicates.config_hash(base)


def test_a_schedule_start_past_the_steps_is_one_line_and_writes_nothing(tmp_path):
    job_dir = tmp_path / "bad"
    proc = run_launcher(
        ["train.steps=4", "train.schedule_start=4", f"hydra.run.dir={job_dir}"], cwd=REPO
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: train.schedule_start=4: expected a step from 0 to train.steps-1 (3)"
    ]
    assert not job_dir.exists()


def metrics(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
