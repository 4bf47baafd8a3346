"""Every machine=local job has a supervisor (``batch/supervise.py``), waited for
or not. Real 4-rank gloo jobs of gpt_tiny, through the commands a user types: a rank
killed with SIGKILL, or a SIGTERM to the launcher, leaves no rank running and job.json
final with its failure class; ``jobs resubmit ... wait=true`` follows the new attempt to
its end, and the status table's STEP is the step that attempt reached.

``AXONN_FAULT=pause@stepN:S`` keeps every rank asleep outside any collective, so no rank
would notice a dead peer by itself: only the supervisor can end them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO, run_launcher

QUICK = ["machine=local", "model=gpt_tiny", "train.warmup_steps=0", "train.sample_tokens=0",
         "train.progress=false"]  # fmt: skip
PAUSED = {"AXONN_FAULT": "pause@step2:300"}  # every rank sleeps after step 2's update
NO_RANK_AFTER_S = 30


def rank_pids(job_dir: Path) -> list[int]:
    """Live processes (zombies excluded) running ``python -m axonn_launch.train <job_dir>``,
    or forked as a rank of that job by the warm start (named ``axonn-rank-<N>``, with the
    zygote's command line), found in /proc: the process table itself, not what the launcher
    recorded."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        rank = "axonn_launch.train" in argv or comm.startswith("axonn-rank-")
        if rank and str(job_dir) in argv and state != "Z":
            found.append(int(entry.name))
    return sorted(found)


def alive(pid: int) -> bool:
    """Running (a zombie, ended but not yet reaped by its parent, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def poll(check: Callable[[], object], timeout: float, what: str) -> object:
    """``check()``'s first truthy value within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.25)


def record(job_dir: Path) -> dict:
    try:
        return json.loads((job_dir / "job.json").read_text())
    except (OSError, ValueError):
        return {}


def paused_on_every_rank(job_dir: Path, console: Path) -> bool:
    """Each rank printed that it sleeps (rank 0 to ``console``)."""
    logs = [console, *(job_dir / "logs" / f"rank_{r}.log" for r in range(1, 4))]
    return all(p.exists() and "AXONN_FAULT: injecting pause" in p.read_text() for p in logs)


def status_rows(root: Path, cwd: Path) -> dict[str, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "axonn_launch.jobs", "status", "--json", str(root)],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return {Path(r["job_dir"]).name: r for r in json.loads(proc.stdout)}


@pytest.fixture
def reap(tmp_path):
    """Whatever a failing test leaves running under tmp_path is ended (its own ranks only)."""
    yield
    for pid in rank_pids_under(tmp_path):
        os.kill(pid, signal.SIGKILL)


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def zygote(pid: int) -> bool:
    """Whether ``pid`` is a job's warm start (``python -m axonn_launch.train.zygote``)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return "axonn_launch.train.zygote" in argv


def rank_pids_under(root: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and "axonn_launch" in argv and str(root) in argv:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_a_killed_rank_of_a_detached_job_ends_every_rank_and_the_record(tmp_path, reap):
    job = tmp_path / "job"
    launched = run_launcher([*QUICK, "train.steps=6", "wait=false", f"hydra.run.dir={job}"],
                            cwd=REPO, env=PAUSED, timeout=300)  # fmt: skip
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    job_id = record(job)["job_ids"][0]
    supervisor = int(job_id.removeprefix("local-"))
    console = job / "axonn_launch.log"  # a detached job's console: the launch's log
    poll(lambda: paused_on_every_rank(job, console), 240, "every rank sleeping after step 2")
    running = rank_pids(job)
    assert len(running) == 4 and running == sorted(record(job)["rank_pids"])
    for pid in running:  # the supervisor owns them (or its warm start does), not init
        parent = parent_pid(pid)
        assert parent == supervisor or (zygote(parent) and parent_pid(parent) == supervisor)
    assert record(job)["status"] == "running"

    victim = record(job)["rank_pids"][2]
    os.kill(victim, signal.SIGKILL)
    poll(lambda: not rank_pids(job), NO_RANK_AFTER_S, "no rank process left")
    poll(lambda: not alive(supervisor), 30, "the supervisor ended")
    final = record(job)
    assert final["status"] == "failed" and final["exit_code"] == 128 + signal.SIGKILL
    assert final["rank_exit_codes"] == [-signal.SIGTERM, -signal.SIGTERM, -signal.SIGKILL,
                                        -signal.SIGTERM]  # fmt: skip
    assert final["ended_by"]["rank"] == 2 and final["ended_by"]["signal"] == "SIGKILL"
    assert final["failure"] == "rank_killed"
    line = f"rank 2 (pid {victim}) was killed by SIGKILL: stopped ranks 0, 1, 3"
    assert final["failure_reason"] == line
    row = status_rows(job, REPO)["job"]  # jobs status says the same as the supervisor
    assert (row["job_id"], row["state"], row["failure"], row["reason"]) == (
        job_id, "ENDED", "rank_killed", line
    )  # fmt: skip
    rows = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == rows[-1]["step"] == 1  # the pause came before step 2's row
    assert record(job)["status"] == "failed"  # status found nothing to settle
    assert f"supervisor: {line}" in console.read_text()


@pytest.mark.slow
def test_sigterm_to_a_waiting_launcher_stops_its_ranks_and_ends_the_record(tmp_path, reap):
    job = tmp_path / "job"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out, err = tmp_path / "console.out", tmp_path / "console.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "axonn_launch", *QUICK, "train.steps=6",
             f"hydra.run.dir={job}"],
            cwd=REPO, env={**env, **PAUSED}, stdout=stdout, stderr=stderr,
        )  # fmt: skip
        try:
            poll(lambda: paused_on_every_rank(job, out), 240, "every rank sleeping")
            assert len(rank_pids(job)) == 4 and record(job)["status"] == "running"
            launcher.send_signal(signal.SIGTERM)
            poll(lambda: not rank_pids(job), NO_RANK_AFTER_S, "no rank process left")
            code = launcher.wait(timeout=60)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    final = record(job)
    assert code == 1, err.read_text()[-2000:]
    assert final["status"] == "failed" and final["exit_code"] == 128 + signal.SIGTERM
    assert final["rank_exit_codes"] == [-signal.SIGTERM] * 4
    assert final["ended_by"]["signal"] == "SIGTERM" and "rank" not in final["ended_by"]
    assert final["failure"] == "cancelled"  # as scancel is on Slurm: resume when asked
    assert not alive(int(final["job_ids"][0].removeprefix("local-")))
    assert "supervisor: SIGTERM: stopped ranks 0, 1, 2, 3" in err.read_text()
    assert "AXONN_FAULT: injecting pause after step 2 on rank 0" in out.read_text()
    assert "Traceback" not in err.read_text()
    row = status_rows(job, REPO)["job"]
    assert (row["state"], row["failure"]) == ("CANCELLED by SIGTERM", "cancelled")


@pytest.mark.slow
def test_a_resubmit_with_wait_true_follows_the_attempt_and_step_is_the_one_it_reached(
    tmp_path, reap
):
    """The first run checkpoints step 3 and fails at step 5 (rows 1-4); its attempt resumes
    from step 3 and fails before it logs a step: it reached step 3, not the old run's 4."""
    steps = [*QUICK, "train.steps=6", "train.checkpoint_every=3"]
    first = run_launcher([*steps, "hydra.run.dir=jobs/first"], cwd=tmp_path, timeout=300,
                         env={"AXONN_FAULT": "collective@step5:rank1"})  # fmt: skip
    assert first.returncode == 1, first.stderr[-2000:]
    old_rows = (tmp_path / "jobs/first/metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in old_rows] == [1, 2, 3, 4]
    assert record(tmp_path / "jobs/first")["failure"] == "collective_failure"

    again = subprocess.run(
        [sys.executable, "-m", "axonn_launch.jobs", "resubmit", "jobs/first", "wait=true"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "AXONN_FAULT": "code@step4:rank1"},
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    attempt = tmp_path / "jobs/first_attempt2"
    final = record(attempt)  # read as the command returned: the attempt had ended
    assert final["status"] == "failed" and final["failure"] == "code_error", final
    assert (final["attempt"], final["parent"]) == (2, "jobs/first")  # as the command named it
    assert not alive(int(final["job_ids"][0].removeprefix("local-")))
    assert not rank_pids(attempt)
    assert "started local-" not in again.stdout  # not detached
    lines = again.stdout.strip().splitlines()
    assert lines[-3].startswith(f"resubmitted {record(tmp_path / 'jobs/first')['job_ids'][0]}")
    assert lines[-2:] == [
        "  resumes from step 3 (checkpoints/step_00000003)",
        "  the attempt ended failed (exit code 1)",
    ], lines[-6:]
    rows = [json.loads(x) for x in (attempt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # the old rows through the checkpoint
    row = status_rows(tmp_path / "jobs", tmp_path)["first_attempt2"]
    assert (row["state"], row["failure"], row["step"]) == ("ENDED", "code_error", 3)
