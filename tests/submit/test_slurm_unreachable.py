"""Slurm that cannot be reached is no verdict. Slurm's own client commands (sacct, squeue)
meet a controller and an accounting daemon that do not answer: the cluster's slurm.conf
with their ports moved to ports nothing listens on. ``jobs status`` then shows a running
job's last known state and its age, in one line says that Slurm is unreachable, and
neither classes it nor lets ``jobs resubmit`` act; a follower (``wait=true``) says once
that accounting is unreachable, with none of submitit's repeated warnings. The same with
the real daemons stopped: ``tests/slurm/test_slurm_down.py``.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import socket
import time
from pathlib import Path

import pytest

from axonn_launch import jobs
from axonn_launch.common.jobdir import read_record, write_record_file
from axonn_launch.records.status import SEEN, collect
from axonn_launch.scheduler import slurm_jobs

SLURM_CONF = Path("/etc/slurm/slurm.conf")
pytestmark = pytest.mark.skipif(
    shutil.which("sacct") is None or not SLURM_CONF.is_file(),
    reason="needs Slurm's client commands and a slurm.conf (machines/slurm_local/start.sh)",
)
JOB_ID = "987654321"  # never a job of the local cluster: Slurm could not tell it anyway
STEPS, REACHED = 100, 23
SEEN_AGO_S = 300  # shown as 5 min


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def unreachable(tmp_path, monkeypatch) -> Path:
    """SLURM_CONF: the cluster's slurm.conf with slurmctld and slurmdbd at ports nothing
    listens on (``MessageTimeout=1``: each refusal takes milliseconds, not retries)."""
    moved = ("SlurmctldPort=", "AccountingStoragePort=", "MessageTimeout=")
    lines = [ln for ln in SLURM_CONF.read_text().splitlines() if not ln.startswith(moved)]
    lines += [f"SlurmctldPort={free_port()}", f"AccountingStoragePort={free_port()}",
              "MessageTimeout=1"]  # fmt: skip
    folder = tmp_path / "etc"
    folder.mkdir()
    (folder / "slurm.conf").write_text("\n".join(lines) + "\n")
    for other in SLURM_CONF.parent.glob("*.conf"):  # gres.conf and the like, as they are
        if other.name not in ("slurm.conf", "slurmdbd.conf"):
            shutil.copy(other, folder / other.name)
    monkeypatch.setenv("SLURM_CONF", str(folder / "slurm.conf"))
    return folder / "slurm.conf"


def running_job(job_dir: Path) -> Path:
    """A Slurm job's dir as the launcher leaves it while the job runs: job.json "running"
    with the state ``jobs status`` last saw, and metrics up to step REACHED."""
    job_dir.mkdir(parents=True)
    record = {"job_ids": [JOB_ID], "name": "gpt_tiny-slurm_local", "machine": "slurm_local",
              "scheduler": "slurm", "status": "running", "steps": STEPS, "nodes": 1,
              "tasks_per_node": 2, "grid": {"data": 1, "x": 2, "y": 1, "z": 1},
              "submit_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "submitted_at": time.time() - 600, "recovery": {}, "chain": {"state": "running"},
              SEEN: {"state": "RUNNING", "at": time.time() - SEEN_AGO_S}}  # fmt: skip
    write_record_file(job_dir, record)
    rows = [
        {"step": s, "loss": 10.0 - s / 10, "tokens_per_s": 1000.0} for s in range(1, REACHED + 1)
    ]
    (job_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return job_dir


def test_status_keeps_the_last_known_state_and_never_classes_it(unreachable, tmp_path, capsys):
    job = running_job(tmp_path / "jobs" / "run")
    (row,) = collect([str(job)])
    assert row.unreachable and "squeue" in row.unreachable and "sacct" in row.unreachable
    assert (row.state, row.failure, row.action, row.step) == ("RUNNING?", "", "", REACHED)

    assert jobs.main(["status", str(job)]) == 0
    shown = capsys.readouterr().out
    said = [ln for ln in shown.splitlines() if ln.startswith("Slurm unreachable (")]
    assert len(said) == 1 and "1 job(s) show their last known state" in said[0], shown
    assert "ENDED" not in shown and "(action:" not in shown, shown
    age = re.search(r"last seen RUNNING (\d+) min ago", shown)
    assert age and int(age.group(1)) == round(SEEN_AGO_S / 60), shown
    assert read_record(job)["status"] == "running" and "failure" not in read_record(job)

    assert jobs.main(["resubmit", "--dry-run", str(job)]) == 0
    skipped = capsys.readouterr().out
    assert skipped.startswith(f"skip  {JOB_ID} ") and "Slurm unreachable" in skipped, skipped
    assert not list(job.parent.glob("run_attempt*"))


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_follower_says_once_that_accounting_is_unreachable(unreachable, tmp_path, capsys):
    """sacct fails at every check (about 8 in 40 virtual seconds); the job's result appears
    at 40 s: the follower returns its state from the result, having said one line."""
    import submitit
    from submitit.core.utils import cloudpickle_dump

    job = submitit.SlurmJob(folder=tmp_path / "slurm", job_id=JOB_ID)
    job.paths.folder.mkdir(parents=True)
    clock, out = VirtualClock(), tmp_path / "follower.out"
    calls = job.watcher.num_calls

    def sleep(seconds: float) -> None:
        clock.now += seconds
        if clock.now >= 40 and not job.paths.result_pickle.exists():
            cloudpickle_dump(("success", {"steps": STEPS}), job.paths.result_pickle)

    with open(out, "w") as handle:
        state = slurm_jobs.follow(job, out=handle, clock=clock, sleep=sleep)
    assert state == "COMPLETED"
    assert job.watcher.num_calls - calls >= 6  # sacct was asked (and failed) again and again
    lines = out.read_text().splitlines()
    said = [ln for ln in lines if ln.startswith("accounting unreachable")]
    assert said == [f"accounting unreachable (sacct exit status 1): following job {JOB_ID}"
                    " through squeue and its result files"], lines  # fmt: skip
    console = capsys.readouterr()
    assert "Bypassing" not in console.out + console.err + out.read_text()
    assert pickle.loads(job.paths.result_pickle.read_bytes())[0] == "success"
