"""A job dir holds one run: a second launch into a dir whose job lives is refused
in one line naming the holder, and the first run is unharmed (its metrics one row per step,
its job.json its own); a relaunch into the finished dir is refused and its summary.json
stays as it was; ``resume=true`` with another model is refused on the login node in one
line, making no attempt dir; a read-only job dir (a real read-only mount) is one line and
exit code 2. One real detached 1-rank gpt_tiny run, shared by the module; the rest are
checks on the login node (``submit/dirguard.py``)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import JobPaths, read_record, update_record, write_record_file
from axonn_launch.config.compose import ConfigError, LaunchConfig, compose, to_launch_config
from axonn_launch.scheduler import processes
from axonn_launch.submit import dirguard, dirlock
from tests.conftest import REPO, run_launcher
from tests.submit.test_local_supervisor import poll

N = 3  # one checkpoint, at the end
RUN = ["machine=local", "model=gpt_tiny", "grid.x=1", "grid.z=1", f"train.steps={N}",
       "train.sample_tokens=0", "train.progress=false",
       "train.gemm_tuning=false", "train.eval_batches=0"]  # fmt: skip
STEP = f"step_{N:08d}"
# each step from the second on sleeps 1 s: the run lives while the second launch is refused
SLOW = {"AXONN_FAULT": "slow@step1:1"}
RUN_ENDS_S = 240


def only_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    return lines[0]


@pytest.fixture(scope="module")
def local_cfg() -> LaunchConfig:
    """RUN's config, composed once (Hydra's compose takes a second or two)."""
    return to_launch_config(compose(RUN))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """A detached run, a second launch into its dir while it lives, then (once it ended) a
    relaunch and a resume with another model into the finished dir."""
    job = tmp_path_factory.mktemp("lock") / "job"
    first = run_launcher([*RUN, "wait=false", f"hydra.run.dir={job}"], cwd=REPO, env=SLOW)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_launcher([*RUN, "train.lr=1e-3", f"hydra.run.dir={job}"], cwd=REPO)
    live = processes.live_supervisors([job])  # still running after the second launch
    poll(lambda: read_record(job).get("status") != "running", RUN_ENDS_S, "the run ended")
    poll(lambda: not processes.live_supervisors([job]), 30, "its supervisor ended")
    summary = JobPaths(job).summary.read_bytes()
    again = run_launcher([*RUN, f"hydra.run.dir={job}"], cwd=REPO)
    other = run_launcher(["model=llama_tiny", *RUN[2:], "resume=true", f"hydra.run.dir={job}"],
                         cwd=REPO)  # fmt: skip
    return {"job": job, "second": second, "live": live, "summary": summary, "again": again,
            "other": other}  # fmt: skip


def test_a_second_launch_into_a_live_dir_is_refused_and_the_first_is_unharmed(run):
    job = run["job"]
    assert run["live"], "the run ended before the second launch: nothing was tested"
    record = read_record(job)
    (job_id,) = record["job_ids"]  # one record: the first launch's
    pid = job_id.removeprefix("local-")
    assert only_line(run["second"]).startswith(
        f"error: job dir {job} is in use by local job {job_id} (pid {pid} on "
    ), run["second"].stderr
    assert "train.lr=1e-3" not in (job / ".hydra" / "overrides.yaml").read_text()
    assert record["status"] == "completed", (job / "axonn_launch.log").read_text()[-3000:]
    rows = [json.loads(line) for line in JobPaths(job).metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, N + 1))  # strictly increasing
    assert dirlock.held_by(job) is None  # let go when the supervisor ended


def test_a_relaunch_into_a_finished_dir_is_refused_and_its_summary_kept(run):
    job = run["job"]
    line = only_line(run["again"])
    assert line.startswith(f"error: job dir {job} holds a run already (job local-"), line
    assert f"completed; checkpoint {STEP}; a finished run's summary.json)" in line, line
    assert "resume=true" in line and f"jobs resubmit {job}" in line
    assert JobPaths(job).summary.read_bytes() == run["summary"]
    assert json.loads(run["summary"])["steps"] == N


def test_resume_with_another_model_is_refused_on_the_login_node(run):
    job = run["job"]
    line = only_line(run["other"])
    step = job / "checkpoints" / STEP
    assert line.startswith(
        f"error: resume=true: {step} holds model gpt_tiny and this launch's is llama_tiny ("
    ), line
    assert "a run resumes its own model only" in line
    assert not (job.parent / "job_attempt2").exists()  # no attempt made
    assert JobPaths(job).summary.read_bytes() == run["summary"]


def test_resume_continues_as_a_new_attempt_beside_the_run(run, local_cfg):
    """What ``resume=true`` would launch into, checked on the login node: the attempt dir
    beside the run; too few steps, or a dir with no run, are one line each."""
    job = run["job"]
    same = replace(local_cfg, resume=True)
    more = replace(same, train=replace(same.train, steps=9))
    assert dirguard.check(job, more) == job.parent / "job_attempt2"
    with pytest.raises(ConfigError, match=rf"train.steps={N}: .*{STEP} is at step {N}"):
        dirguard.check(job, same)
    with pytest.raises(ConfigError, match="holds no run to continue"):
        dirguard.check(job.parent / "empty", more)


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder on a tmpfs mounted read-only (root ignores file modes, not a read-only
    mount); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "ro"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        (mount / "old").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_read_only_job_dir_is_one_line_and_exit_2(read_only_dir: Path):
    with pytest.raises(OSError, match="Read-only file system"):
        (read_only_dir / "probe").write_text("")  # the mount is read-only for root too
    for job in (read_only_dir / "old", read_only_dir / "new" / "job"):
        proc = run_launcher([*RUN, f"hydra.run.dir={job}"], cwd=REPO)
        where = job if job.exists() else read_only_dir
        assert only_line(proc) == (
            f"error: cannot write the job dir {job}: {where} is on a read-only file system;"
            " choose another hydra.run.dir"
        )


def test_two_launches_at_once_one_is_refused_naming_the_other(tmp_path, local_cfg):
    """The lock is taken before anything is written: while one launch holds it (here this
    process), another into the same dir is refused naming it, and may go once it let go."""
    job, cfg = tmp_path / "job", local_cfg
    held = dirguard.take(job)
    try:
        assert dirlock.held_by(job) == f"a launch ({dirlock.here()})"
        with pytest.raises(ConfigError, match=rf"^job dir {job} is in use by a launch \(pid "):
            dirguard.check(job, cfg)
        with pytest.raises(ConfigError, match="is in use by a launch"):
            dirguard.take(job)
    finally:
        held.release()
    assert dirlock.held_by(job) is None and dirguard.check(job, cfg) == job


def test_a_continuation_whose_job_never_started_is_undone(tmp_path):
    """sbatch refused it, or the launch failed: the run dir is no longer marked and the
    attempt's seeded checkpoint and metrics go, so that resume=true can make it again; an
    attempt whose job started keeps them."""
    parent, target = tmp_path / "job", tmp_path / "job_attempt2"
    parent.mkdir()
    write_record_file(parent, {"job_ids": ["local-1"], "resubmitted_as": str(target)})
    for started in ([], ["local-2"]):
        (target / "checkpoints" / "step_00000002").mkdir(parents=True, exist_ok=True)
        JobPaths(target).metrics.write_text('{"step": 1}\n')
        write_record_file(target, {"job_ids": started, "status": "refused"})
        dirguard.undo_continuation(target, {"parent": str(parent)})
        kept = bool(started)
        assert JobPaths(target).checkpoints.exists() == kept
        assert JobPaths(target).metrics.exists() == kept
        assert bool(read_record(parent)["resubmitted_as"]) == kept
        update_record(parent, resubmitted_as=str(target))
