"""Failures on the real local Slurm cluster: each is caused for real (or injected with
``AXONN_FAULT``), ``jobs status`` must name it, ``jobs resubmit`` must bring the job back
from its checkpoint (or refuse), and the resumed job must end at the loss of a run that
was never interrupted.

Every job is a 2-rank, one-node ``gpt_tiny`` run of 16 steps with a checkpoint every 4.
The jobs of all scenarios are submitted together by one fixture and run side by side;
then every scenario is driven at once (the ``wave`` fixture: fault, ``jobs status``,
resubmission and the resumed job's end, each scenario in a thread), and each test raises
what its scenario's checks raised. A lost node (``node_failure``, its node left out of the
next attempt) is tests/slurm/test_recovery.py's, a node whose slurmd stops for real
(``node.sh stop``), healed by the recovery chain, and tests/slurm/test_restart_in_place.py's,
a node set DOWN, healed inside the job (tests/README.md). External faults (kill -9, scancel)
act while the job sleeps after step 9 (``pause``), so the latest checkpoint is step 8.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import checkpointed_step
from tests.cli_server import run_module
from tests.conftest import run_launcher

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 16
TRAIN = [
    "machine=slurm_local",
    "grid.x=2",
    f"train.steps={STEPS}",
    "train.sample_tokens=0",
    "train.checkpoint_every=4",
    "recovery=off",  # each scenario is brought back by hand here (test_recovery.py: by itself)
    "preflight=false",  # tests/slurm/test_preflight_on_slurm.py runs it, with its resubmission
    "force=true",  # the reference and the faulted runs share one config, side by side
]
PAUSED = "pause@step9:600"
ACTIVE = ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "")

SCENARIOS = {
    # name: (AXONN_FAULT, extra overrides, extra environment)
    "reference": ("", [], {}),
    "kill9": (PAUSED, [], {}),
    "scancel": (PAUSED, [], {}),
    "kill_srun": (PAUSED, [], {}),
    "kill_stepd": (PAUSED, [], {}),
    "collective": ("collective@step6:rank1", [], {}),
    "gpu_oom": ("gpu_oom@step6:rank1", [], {}),
    "code": ("code@step6", [], {}),
    # USR2 30 s before a 2-minute limit (Slurm may send it up to a minute earlier), while
    # steps take 6 s; no requeue allowed, so the job stops at a checkpoint and fails
    "timeout": ("slow@step1:6", ["machine.slurm.time_min=2", "max_requeue=0"], {}),
    # the same with requeues allowed: the job requeues itself and finishes on its own, in
    # a recovery chain (submitted --no-requeue: the requeue turns requeueing on for itself)
    "requeue": ("slow@step1:6", ["machine.slurm.time_min=2", "max_requeue=3", "recovery=auto"], {}),
}


@dataclass
class Job:
    name: str
    job_dir: Path
    job_id: str


def sacct_state(job_id: str) -> tuple[str, str]:
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "State,NodeList", "-j", job_id],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    state, _, nodes = (out.splitlines() or ["|"])[-1].partition("|")
    return state, nodes


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 1.0):
    deadline = time.time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.time() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(poll_s)


def wait_ended(job_id: str, timeout_s: float = 420) -> str:
    def ended():
        state = sacct_state(job_id)[0]
        return state if state.split(" ")[0] not in ACTIVE else None

    return wait_until(ended, timeout_s, f"job {job_id} to end")


def submit(name: str, root: Path) -> Job:
    fault, overrides, env = SCENARIOS[name]
    job_dir = root / name
    chained = any(o.startswith("recovery=") for o in overrides)
    train = [o for o in TRAIN if not (chained and o == "recovery=off")]
    result = run_launcher(
        [*train, *overrides, f"hydra.run.dir={job_dir}"],
        cwd=root,
        env={"AXONN_FAULT": fault, **env},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads((job_dir / "job.json").read_text())
    return Job(name, job_dir, record["job_ids"][0])


def jobs_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "AXONN_FAULT"}
    return run_module("axonn_launch.jobs", list(args), cwd=cwd, env=env, timeout=300)


def status_of(job_dir: Path) -> dict:
    result = jobs_cli("status", str(job_dir), "--json", cwd=job_dir.parent)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    return row


def losses(job_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def paused_at_step_9(job: Job) -> bool:
    """The job sleeps after step 9 with checkpoint 8 complete."""
    log = job.job_dir / "slurm" / job.job_id / f"{job.job_id}_0_log.out"
    pointer = job.job_dir / "checkpoints" / "latest"
    return (
        log.exists()
        and "injecting pause after step 9" in log.read_text()
        and pointer.exists()
        and pointer.read_text().strip() == "step_00000008"
    )


def processes() -> Iterator[tuple[int, list[bytes], dict[bytes, bytes], bytes]]:
    """(pid, argv, environment, the parent's argv[0]) of every process we may read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(
                item.split(b"=", 1)
                for item in (entry / "environ").read_bytes().split(b"\0")
                if b"=" in item
            )
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            parent_argv0 = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")[0]
        except (OSError, ValueError):
            continue
        yield int(entry.name), argv, environ, parent_argv0


def rank_pids(job_id: str) -> dict[int, int]:
    """Slurm task rank -> pid of the Python process running it, from /proc."""
    return {
        int(environ[b"SLURM_PROCID"]): pid
        for pid, argv, environ, _ in processes()
        if b"submitit.core._submit" in argv
        and b"python" in argv[0]
        and environ.get(b"SLURM_JOB_ID") == job_id.encode()
    }


def launcher_pids(job_id: str) -> dict[str, int]:
    """pids of the batch script's srun (not srun's helper child) and of step 0's slurmstepd."""
    found = {}
    for pid, argv, environ, parent_argv0 in processes():
        if argv[0] == f"slurmstepd: [{job_id}.0]".encode():
            found["slurmstepd"] = pid
        elif (
            argv[0] == b"srun"
            and environ.get(b"SLURM_JOB_ID") == job_id.encode()
            and parent_argv0 != b"srun"
        ):
            found["srun"] = pid
    return found


def check_kill_9_of_srun_or_slurmstepd(submitted, reference, victim):
    """No Python error anywhere: the job was killed, and it resumes like a killed rank."""
    job = submitted["kill_srun" if victim == "srun" else "kill_stepd"]
    wait_until(lambda: paused_at_step_9(job), 300, f"{job.name} job to pause after step 9")
    pids = launcher_pids(job.job_id)
    assert victim in pids, pids
    os.kill(pids[victim], signal.SIGKILL)
    ended = wait_ended(job.job_id)
    if victim == "slurmstepd":
        # srun loses the step and exits 0, so sacct says COMPLETED; the ranks live on
        # unsupervised (proctrack/linuxproc), where a site's cgroups would end them
        assert ended == "COMPLETED", ended
        for pid in rank_pids(job.job_id).values():
            os.kill(pid, signal.SIGKILL)
    else:
        assert ended.startswith("FAILED"), ended
    row = status_of(job.job_dir)
    assert (row["failure"], row["action"], row["step"]) == ("rank_killed", "resume", 8), row
    resubmit_and_finish(job, reference, resumed_step=8)


def resubmit_and_finish(
    job: Job,
    reference: Job,
    *extra: str,
    resumed_step: int,
    rel: float = 1e-6,
    concurrent: int = 1,
) -> Path:
    """Resubmit ``job`` (with ``concurrent`` commands at once); check that exactly one
    new attempt was submitted, that it resumes and ends at the reference loss.

    On the same grid the losses agree to float32 rounding; on another grid (resharded
    checkpoint) the sums run in another order, hence a looser ``rel``.
    """
    env = {k: v for k, v in os.environ.items() if k != "AXONN_FAULT"}
    command = [sys.executable, "-m", "axonn_launch.jobs", "resubmit", str(job.job_dir), *extra]
    procs = [
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(concurrent)
    ]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outputs
    stdout = [out for out, _ in outputs]
    assert sum(f"resubmitted {job.job_id} " in out for out in stdout) == 1, stdout
    assert sum("already resubmitted" in out for out in stdout) == concurrent - 1, stdout
    new_dir = job.job_dir.with_name(f"{job.job_dir.name}_attempt2")
    record = json.loads((new_dir / "job.json").read_text())
    assert record["attempt"] == 2 and record["parent"] == str(job.job_dir)
    assert json.loads((job.job_dir / "job.json").read_text())["resubmitted_as"] == str(new_dir)
    state = wait_ended(record["job_ids"][0])
    assert state == "COMPLETED", (state, tail_logs(new_dir))
    summary = json.loads((new_dir / "summary.json").read_text())
    assert summary["resumed_from"] == resumed_step
    assert summary["steps_run"] == STEPS - resumed_step
    assert losses(new_dir)[STEPS] == pytest.approx(losses(reference.job_dir)[STEPS], rel=rel)
    assert status_of(new_dir)["failure"] == "completed"
    return new_dir


def tail_logs(job_dir: Path) -> str:
    return "\n".join(p.read_text()[-1500:] for p in sorted(job_dir.glob("slurm/*/*_0_log.*")))


@pytest.fixture(scope="module")
def submitted(slurm_cluster, tmp_path_factory) -> Iterator[dict[str, Job]]:
    root = tmp_path_factory.mktemp("faults")
    started = {name: submit(name, root) for name in SCENARIOS}
    yield started
    # a failed test may leave its job paused; end every job of this module
    ids = [job.job_id for job in started.values()]
    ids += [
        str(i)
        for p in root.glob("*_attempt*/job.json")
        for i in json.loads(p.read_text())["job_ids"]
    ]
    subprocess.run(["scancel", *ids], capture_output=True)


@pytest.fixture(scope="module")
def reference(submitted) -> Job:
    job = submitted["reference"]
    assert wait_ended(job.job_id) == "COMPLETED", tail_logs(job.job_dir)
    return job


def check_kill_9_of_one_rank(submitted, reference):
    job = submitted["kill9"]
    wait_until(lambda: paused_at_step_9(job), 300, "kill9 job to pause after step 9")
    pids = rank_pids(job.job_id)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGKILL)
    assert wait_ended(job.job_id).startswith("FAILED")
    row = status_of(job.job_dir)
    assert row["failure"] == "rank_killed" and row["action"] == "resume", row
    assert row["step"] == 8  # step 9 was computed, not logged or saved, when it paused
    resubmit_and_finish(job, reference, resumed_step=8)


def check_scancel(submitted, reference):
    job = submitted["scancel"]
    wait_until(lambda: paused_at_step_9(job), 300, "scancel job to pause after step 9")
    subprocess.run(["scancel", job.job_id], check=True)
    assert wait_ended(job.job_id).startswith("CANCELLED")
    assert status_of(job.job_dir)["failure"] == "cancelled"
    # two resubmit commands at once, then a third: one submission in all
    new_dir = resubmit_and_finish(job, reference, resumed_step=8, concurrent=2)
    again = jobs_cli("resubmit", str(job.job_dir), cwd=job.job_dir.parent)
    assert again.returncode == 0 and "already resubmitted" in again.stdout, again.stdout
    assert sorted(p.name for p in job.job_dir.parent.glob("scancel*")) == [
        "scancel",
        "scancel_attempt2",
    ]
    assert len(json.loads((new_dir / "job.json").read_text())["job_ids"]) == 1


def check_injected_collective_error(submitted, reference):
    """Rank 1 raises a collective error at step 6. The step-4 checkpoint is saved
    asynchronously, and on a loaded machine it can still be in flight then: the failed rank
    lets it complete before it ends (``Checkpointer.finish_in_flight``), so the
    resubmission resumes from step 4."""
    job = submitted["collective"]
    assert wait_ended(job.job_id).startswith("FAILED")
    row = status_of(job.job_dir)
    assert row["failure"] == "collective_failure", row
    assert "NCCL error" in row["reason"]
    (node,) = row["bad_nodes"]  # rank 1 reported the error; both ranks share one node
    assert node == sacct_state(job.job_id)[1]
    assert checkpointed_step(job.job_dir) == 4
    new_dir = resubmit_and_finish(job, reference, resumed_step=4)
    record = json.loads((new_dir / "job.json").read_text())
    assert f"--exclude={node}" in (new_dir / "submission.sh").read_text()
    assert sacct_state(record["job_ids"][0])[1] != node  # it ran on the other node


def check_out_of_memory_and_code_errors_are_not_resubmitted(submitted, reference, name, failure):
    job = submitted[name]
    assert wait_ended(job.job_id).startswith("FAILED")
    row = status_of(job.job_dir)
    assert row["failure"] == failure, row
    result = jobs_cli("resubmit", str(job.job_dir), cwd=job.job_dir.parent)
    assert result.returncode == 0 and result.stdout.startswith("skip"), result.stdout
    assert not job.job_dir.with_name(f"{name}_attempt2").exists()
    assert "resubmitted_as" not in json.loads((job.job_dir / "job.json").read_text())
    if name == "gpu_oom":  # with a new grid it is worth another try: x=2 -> data=2
        assert checkpointed_step(job.job_dir) == 4  # completed by the failed rank, as above
        new_dir = resubmit_and_finish(
            job,
            reference,
            "grid.x=1",
            "grid.data=2",
            "train.micro_batch=8",  # the same global batch, split over two replicas
            resumed_step=4,
            rel=1e-4,
        )
        assert json.loads((new_dir / "job.json").read_text())["grid"]["data"] == 2


def check_time_limit_stops_at_a_checkpoint_then_resubmits(submitted, reference):
    job = submitted["timeout"]
    assert wait_ended(job.job_id).startswith("FAILED")
    row = status_of(job.job_dir)
    assert row["failure"] == "timeout", row
    stopped_at = int((job.job_dir / "checkpoints" / "latest").read_text().split("_")[1])
    assert row["step"] == stopped_at > 0  # saved at the step boundary after USR2
    resubmit_and_finish(job, reference, "machine.slurm.time_min=10", resumed_step=stopped_at)


def check_time_limit_requeues_itself(submitted, reference):
    job = submitted["requeue"]

    def requeued_pending():
        state = sacct_state(job.job_id)[0]
        if state.startswith("PENDING") and (job.job_dir / "checkpoints" / "latest").exists():
            # a requeued job waits ~2 min for its begin time; let it start now
            subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"])
        return state == "COMPLETED" or state.split(" ")[0] not in ACTIVE

    wait_until(requeued_pending, 420, "requeued job to finish", poll_s=2)
    assert sacct_state(job.job_id)[0] == "COMPLETED", tail_logs(job.job_dir)
    history = subprocess.run(
        ["sacct", "-X", "-n", "-P", "--duplicates", "-o", "State", "-j", job.job_id],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "REQUEUED" in history or history.count("COMPLETED") == 1 and len(history) > 1
    assert "#SBATCH --no-requeue" in (job.job_dir / "submission.sh").read_text()
    assert not job.job_dir.with_name("requeue_attempt2").exists()  # requeued, not recovered
    summary = json.loads((job.job_dir / "summary.json").read_text())
    assert 0 < summary["resumed_from"] < STEPS
    assert losses(job.job_dir)[STEPS] == pytest.approx(losses(reference.job_dir)[STEPS], rel=1e-6)
    assert status_of(job.job_dir)["failure"] == "completed"


# --- the wave: every scenario above at once -------------------------------------------------

WAVE = {  # scenario: (its check, the check's arguments)
    "kill_srun": (check_kill_9_of_srun_or_slurmstepd, ("srun",)),
    "kill_stepd": (check_kill_9_of_srun_or_slurmstepd, ("slurmstepd",)),
    "kill9": (check_kill_9_of_one_rank, ()),
    "scancel": (check_scancel, ()),
    "collective": (check_injected_collective_error, ()),
    "gpu_oom": (check_out_of_memory_and_code_errors_are_not_resubmitted, ("gpu_oom", "gpu_oom")),
    "code": (check_out_of_memory_and_code_errors_are_not_resubmitted, ("code", "code_error")),
    "timeout": (check_time_limit_stops_at_a_checkpoint_then_resubmits, ()),
    "requeue": (check_time_limit_requeues_itself, ()),
}
WAVE_TIMEOUT_S = 1500  # the longest scenario (a requeue after a 2-minute limit) and the fixtures


@pytest.fixture(scope="module")
def wave(submitted, reference) -> dict[str, BaseException | None]:
    """Every scenario's fault, resubmission and checks run at once, each in a thread of its
    own that waits on its own jobs, so that the waits overlap instead of adding up (they
    did, one test after another, for about 7 minutes). What each check raised (None if it
    passed) is raised again by its test."""
    with ThreadPoolExecutor(max_workers=len(WAVE)) as pool:
        futures = {
            name: pool.submit(check, submitted, reference, *args)
            for name, (check, args) in WAVE.items()
        }
        return {name: future.exception() for name, future in futures.items()}


def outcome(wave: dict[str, BaseException | None], name: str) -> None:
    if (error := wave[name]) is not None:
        raise error


@pytest.mark.timeout(WAVE_TIMEOUT_S)
@pytest.mark.parametrize("victim", ["srun", "slurmstepd"])
def test_kill_9_of_srun_or_slurmstepd(wave, victim):
    """No Python error anywhere: the job was killed, and it resumes like a killed rank.
    Over 60 s: the first test of the wave waits for all of it (3 to 4 minutes: its longest
    scenario reaches a 2-minute time limit, then requeues)."""
    outcome(wave, "kill_srun" if victim == "srun" else "kill_stepd")


@pytest.mark.timeout(WAVE_TIMEOUT_S)
def test_kill_9_of_one_rank(wave):
    outcome(wave, "kill9")


@pytest.mark.timeout(WAVE_TIMEOUT_S)
def test_scancel(wave):
    """Two resubmit commands at once, then a third: one submission in all."""
    outcome(wave, "scancel")


@pytest.mark.timeout(WAVE_TIMEOUT_S)
def test_injected_collective_error(wave):
    outcome(wave, "collective")


@pytest.mark.timeout(WAVE_TIMEOUT_S)
@pytest.mark.parametrize("name, failure", [("gpu_oom", "gpu_oom"), ("code", "code_error")])
def test_out_of_memory_and_code_errors_are_not_resubmitted(wave, name, failure):
    assert WAVE[name][1][1] == failure
    outcome(wave, name)


@pytest.mark.timeout(WAVE_TIMEOUT_S)
def test_time_limit_stops_at_a_checkpoint_then_resubmits(wave):
    outcome(wave, "timeout")


@pytest.mark.timeout(WAVE_TIMEOUT_S)
def test_time_limit_requeues_itself(wave):
    outcome(wave, "requeue")
