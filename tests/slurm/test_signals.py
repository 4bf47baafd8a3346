"""Signals on the real local Slurm cluster reach the ranks, and the ranks save first.

- ``scancel --signal=TERM JOB``: every rank stops at the next step boundary, saves there
  and ends without a requeue (submitit used to log "Bypassing signal SIGTERM" and save
  nothing); ``jobs resubmit`` then loses no step that was logged, and the resumed job ends
  at the exact loss of a run never interrupted.
- ``scancel JOB`` whose stop save is cut short (a rank killed in the middle of writing it,
  as the SIGKILL after ``KillWait`` would): ``checkpoints/latest`` still names the last
  complete step, and the job is ``cancelled``, to resume from there.
- ``scancel --signal=USR2 --batch JOB``: the batch shell alone gets the signal. It passes it
  on to the ranks (``submit/render.py``: ``relay_signals``) where it used to die with the
  job (FAILED 0:12, nothing saved): they save at the step reached and the job requeues
  itself, as at a time limit.

Four 2-rank, one-node ``gpt_tiny`` jobs of ``STEPS`` steps are submitted together and run
side by side: a reference, and three slowed to about 1 s a step from step 1
(``slow@step1:1``) so that each is mid-training when it is signalled, just after the
periodic checkpoint of step 4. A signal that comes during that sleep takes effect when it
ends (``time.sleep`` resumes after a Python signal handler), at the same step boundary.
Each scenario then runs in a thread of its own (the ``wave`` fixture, as in
``test_faults.py``), so that the waits overlap, and each test raises what its scenario
raised. Cost, measured on the 2-core machine shared with other test runs: 90 s for the
file, 35 s of it queued behind other jobs on the cluster; the rest is the four jobs'
start-up side by side (about 20 s), four slowed steps, then the resubmitted job's start-up
and last steps (about 20 s). On an idle cluster that is about 55 s.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import run_launcher
from tests.slurm.test_faults import (
    Job,
    jobs_cli,
    losses,
    status_of,
    tail_logs,
    wait_ended,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 12
TRAIN = [
    "machine=slurm_local",
    "grid.x=2",
    f"train.steps={STEPS}",
    "train.sample_tokens=0",
    "train.checkpoint_every=4",
    "train.gemm_tuning=false",  # the same GEMM path in every run: losses agree exactly
    "recovery=off",  # brought back by hand here
    "preflight=false",
    "force=true",  # the reference and the signalled runs share one config, side by side
]
SLOW = {"AXONN_FAULT": "slow@step1:1:attempt1"}
SCENARIOS = {  # name: (environment of the job, scancel's arguments)
    "reference": ({}, ()),
    "term": (SLOW, ("--signal=TERM",)),
    # save 1 is the periodic one of step 4, save 2 the stop's: rank 1 dies in it, after
    # writing its own files (train/checkpoint/manager.py: AXONN_CHECKPOINT_FAULT)
    "cut": ({**SLOW, "AXONN_CHECKPOINT_FAULT": "write@save2:rank1"}, ()),
    "usr2": (SLOW, ("--signal=USR2", "--batch")),
}
SIGNAL_AFTER_STEP = 4  # signal once this step is logged: past the periodic checkpoint 4


def submit(name: str, root: Path) -> Job:
    job_dir = root / name
    result = run_launcher(
        [*TRAIN, f"hydra.run.dir={job_dir}"],
        cwd=root,
        env={"AXONN_FAULT": "", "AXONN_CHECKPOINT_FAULT": "", **SCENARIOS[name][0]},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return Job(name, job_dir, json.loads((job_dir / "job.json").read_text())["job_ids"][0])


@pytest.fixture(scope="module")
def submitted(slurm_cluster, tmp_path_factory) -> Iterator[dict[str, Job]]:
    root = tmp_path_factory.mktemp("signals")
    with ThreadPoolExecutor(max_workers=len(SCENARIOS)) as pool:
        jobs = dict(zip(SCENARIOS, pool.map(lambda name: submit(name, root), SCENARIOS)))
    yield jobs
    ids = [job.job_id for job in jobs.values()]
    for record in root.glob("*_attempt*/job.json"):  # a failed test may leave one running
        ids += json.loads(record.read_text())["job_ids"]
    subprocess.run(["scancel", *ids], capture_output=True)


def logged_step(job: Job) -> int:
    """The last step in the job's metrics (0 before the first)."""
    return max(losses(job.job_dir), default=0) if (job.job_dir / "metrics.jsonl").exists() else 0


def latest_step(job: Job) -> int:
    return int((job.job_dir / "checkpoints" / "latest").read_text().split("_")[1])


def signal_mid_training(job: Job) -> int:
    """Send the scenario's signal once ``SIGNAL_AFTER_STEP`` is logged; returns the step
    logged then."""
    wait_until(lambda: logged_step(job) >= SIGNAL_AFTER_STEP, 300, f"{job.name} to train", 0.2)
    reached = logged_step(job)
    subprocess.run(["scancel", *SCENARIOS[job.name][1], job.job_id], check=True, timeout=30)
    assert reached < STEPS - 2, f"{job.name}: too fast to signal mid-training ({reached})"
    return reached


def in_queue(job_id: str) -> bool:
    """Whether squeue still lists the job (a cancelled one: until its processes ended)."""
    command = ["squeue", "-h", "-j", job_id, "-o", "%T"]
    return bool(subprocess.run(command, capture_output=True, text=True).stdout.strip())


def rank_logs(job: Job) -> str:
    return "\n".join(p.read_text() for p in sorted(job.job_dir.glob("slurm/*/*_log.*")))


def assert_saved_at_the_step_reached(job: Job, reached: int) -> int:
    """The stop is agreed at the next step boundary: the step being computed when the
    signal came is the one saved, and it is the last one logged (nothing logged is lost)."""
    saved = latest_step(job)
    assert reached <= saved <= reached + 2 and saved == logged_step(job) < STEPS, (reached, saved)
    return saved


def check_term(jobs: dict[str, Job]) -> None:
    job, reference = jobs["term"], jobs["reference"]
    reached = signal_mid_training(job)
    state = wait_ended(job.job_id, timeout_s=180)
    assert state.startswith("FAILED"), (state, tail_logs(job.job_dir))  # never COMPLETED
    saved = assert_saved_at_the_step_reached(job, reached)
    logs = rank_logs(job)
    assert "Bypassing signal SIGTERM" not in logs and "Job not requeued" not in logs
    for rank in (0, 1):
        assert f"rank {rank}: SIGTERM: stopped after step {saved}, checkpoint saved" in logs
    row = status_of(job.job_dir)
    assert (row["action"], row["step"]) == ("resume", saved), row
    result = jobs_cli("resubmit", str(job.job_dir), cwd=job.job_dir.parent)
    assert result.returncode == 0 and f"resubmitted {job.job_id} " in result.stdout, result
    new_dir = job.job_dir.with_name("term_attempt2")
    new_id = json.loads((new_dir / "job.json").read_text())["job_ids"][0]
    assert wait_ended(new_id, timeout_s=300) == "COMPLETED", tail_logs(new_dir)
    assert json.loads((new_dir / "summary.json").read_text())["resumed_from"] == saved
    assert wait_ended(reference.job_id, timeout_s=60) == "COMPLETED", tail_logs(reference.job_dir)
    assert losses(new_dir)[STEPS] == losses(reference.job_dir)[STEPS]


def check_cut(jobs: dict[str, Job]) -> None:
    job = jobs["cut"]
    reached = signal_mid_training(job)
    assert wait_ended(job.job_id, timeout_s=180).startswith("CANCELLED")  # at once
    wait_until(lambda: not in_queue(job.job_id), 120, f"job {job.job_id} to be gone", 0.5)
    assert latest_step(job) == 4, tail_logs(job.job_dir)  # the last complete step
    (cut,) = (job.job_dir / "checkpoints").glob(".tmp_step_*")  # the save cut short
    assert reached <= int(cut.name.split("_")[-1]) <= reached + 2, (reached, cut)
    row = status_of(job.job_dir)  # its step is the last one logged: 4 or the cut one
    assert (row["failure"], row["action"]) == ("cancelled", "resume"), row


def check_usr2(jobs: dict[str, Job]) -> None:
    job = jobs["usr2"]
    reached = signal_mid_training(job)

    def history() -> list[str]:
        command = ["sacct", "-X", "-n", "-P", "--duplicates", "-o", "State", "-j", job.job_id]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()

    wait_until(lambda: "REQUEUED" in history(), 180, f"job {job.job_id} to requeue itself")
    saved = assert_saved_at_the_step_reached(job, reached)  # before the requeued run trains
    subprocess.run(["scancel", job.job_id], capture_output=True)  # that run is not needed
    assert not [state for state in history() if state.startswith("FAILED")], history()
    # submitit's handler, which rank 0 calls after the save; the requeue's own TERM may
    # still find rank 1 finishing its part of the stop: it leaves the ending to the requeue
    logs = rank_logs(job)
    assert "Caught signal SIGUSR2" in logs and "SIGTERM: stopped" not in logs and saved


WAVE = {"term": check_term, "cut": check_cut, "usr2": check_usr2}


@pytest.fixture(scope="module")
def wave(submitted) -> dict[str, BaseException | None]:
    """Each scenario's signal and checks in a thread of its own; what each raised."""
    with ThreadPoolExecutor(max_workers=len(WAVE)) as pool:
        futures = {name: pool.submit(check, submitted) for name, check in WAVE.items()}
        return {name: future.exception() for name, future in futures.items()}


def outcome(wave: dict[str, BaseException | None], name: str) -> None:
    if (error := wave[name]) is not None:
        raise error


def test_sigterm_saves_at_the_step_reached_and_the_resume_ends_at_the_reference_loss(wave):
    """Over 60 s with the wait in the queue: the first test waits for the whole wave (the
    jobs' start-up, the signals, then the resubmitted job; module docstring)."""
    outcome(wave, "term")


def test_a_stop_save_cut_short_leaves_latest_at_the_last_complete_step(wave):
    outcome(wave, "cut")


def test_usr2_to_the_batch_shell_reaches_the_ranks_which_save_then_requeue(wave):
    outcome(wave, "usr2")
