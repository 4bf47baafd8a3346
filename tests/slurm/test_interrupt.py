"""Ctrl-C while the launcher follows a Slurm job (``wait=true``), on the real local cluster.

The launcher runs as from a terminal: in a process group of its own, which gets the SIGINT
a Ctrl-C sends (``os.killpg``), the launcher and whatever sacct or squeue it runs alike.

- A running job: one line (the job, ``jobs status`` and ``jobs stop`` for it), exit 130, and
  the job keeps running: squeue and the printed ``jobs status`` say so. The printed
  ``jobs stop`` then cancels it.
- A job held in the queue (``--begin`` an hour from now): its pending line (squeue's reason,
  the time waited) comes at once, and ``jobs status`` gives Slurm's expected start; a
  second Ctrl-C within the window stops it, in one more line, through ``jobs stop``.

Both launches run side by side. Cost on the shared 2-core machine: about 25 s, most of it
the running job's start and the two detach windows (``SECOND_CTRL_C_S``) overlapping.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from axonn_launch.scheduler.slurm_jobs import SECOND_CTRL_C_S
from tests.slurm.test_faults import wait_until

pytestmark = [pytest.mark.slurm]

# steps for far longer than the test: a 500-step job (47 s) ended, under the suite's load,
# between the test seeing it RUNNING and the Ctrl-C; the test cancels it (jobs stop, scancel)
BASE = ["machine=slurm_local", "grid.x=2", "train.steps=50000", "recovery=off",
        "preflight=false", "train.sample_tokens=0", "wait=true"]  # fmt: skip
REPO = Path(__file__).resolve().parents[2]
HELD = "+machine.slurm.extra_sbatch.begin=now+3600"  # pending (BeginTime) for an hour
SIGNAL_MASKS = ("SigBlk", "SigIgn", "SigCgt")


def as_from_a_terminal() -> None:
    """In the launcher's process before it starts: SIGINT at its default and no signal
    blocked, as a shell starts a foreground command. Both are inherited: once in a suite
    run, both launchers of this test went on for 65 s after their Ctrl-Cs, as though this
    worker process had SIGINT ignored or blocked (the dispositions are in the failure's
    message since: ``Launcher.signals``)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Launcher:
    """``python -m axonn_launch`` in a session of its own, its output in files."""

    def __init__(self, folder: Path, *args: str) -> None:
        self.job_dir = folder / "job"
        self.out, self.err = folder / "out.txt", folder / "err.txt"
        env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "AXONN_FAULT")}
        env["PYTHONPATH"] = str(REPO)  # this checkout's launcher, from any directory
        self.env = env
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "axonn_launch", *BASE, *args,
                 f"hydra.run.dir={self.job_dir}"],
                cwd=folder, env=env, stdout=out, stderr=err, start_new_session=True,
                preexec_fn=as_from_a_terminal,
            )  # fmt: skip

    def copied(self, command: str) -> subprocess.CompletedProcess:
        """A command line the launcher printed, run where it was launched."""
        return subprocess.run(shlex.split(command), cwd=self.job_dir.parent, env=self.env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    def job_id(self) -> str:
        ended = self.process.poll() is not None and not self.lines()
        assert not ended, f"the launcher ended: {self.err.read_text()[-2000:]}"
        submitted = [ln for ln in self.lines() if ln.startswith("submitted job ")]
        return submitted[0].split()[2] if submitted else ""

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()

    def ctrl_c(self) -> None:
        self.before_ctrl_c = self.signals()
        os.killpg(self.process.pid, signal.SIGINT)

    def signals(self) -> str:
        """The launcher's ignored, blocked and caught signal masks (/proc)."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text().splitlines()
        except OSError:
            return "gone"
        return " ".join(ln.replace("\t", "") for ln in status if ln.startswith(SIGNAL_MASKS))

    def wait(self) -> int:
        try:
            return self.process.wait(timeout=SECOND_CTRL_C_S + 60)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the launcher went on after its Ctrl-C (its signals then:"
                f" {self.before_ctrl_c}); stderr: {self.err.read_text()[-1000:]}"
            ) from None

    def end(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def squeue_state(job_id: str) -> str:
    found = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                           text=True, timeout=30).stdout  # fmt: skip
    return found.strip()


def test_ctrl_c_detaches_from_a_running_job_and_twice_stops_a_pending_one(slurm_cluster, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "held").mkdir()
    running, held = Launcher(tmp_path / "run"), Launcher(tmp_path / "held", HELD)
    ids: list[str] = []
    try:
        ids += [wait_until(running.job_id, 120, "job submitted", 0.2)]
        ids += [wait_until(held.job_id, 120, "held job submitted", 0.2)]
        # the held job's first line comes at once: squeue gives BeginTime from the start
        wait_until(lambda: any("pending (BeginTime)" in ln for ln in held.lines()), 30,
                   "the pending line", 0.2)  # fmt: skip
        pending = [ln for ln in held.lines() if "pending" in ln]
        assert pending == [f"job {ids[1]} pending (BeginTime): {pending[0].split(': ')[1]}"]
        assert pending[0].endswith("in the queue so far"), pending
        # jobs status says when Slurm expects it to start (squeue --start: its --begin)
        shown = held.copied(f"{shlex.quote(sys.executable)} -m axonn_launch.jobs status ./job")
        start = [ln for ln in shown.stdout.splitlines() if "pending: Slurm expects" in ln]
        assert len(start) == 1 and start[0].endswith("it waits for: BeginTime"), shown.stdout

        wait_until(lambda: squeue_state(ids[0]) == "RUNNING", 300, "job running", 0.5)
        before = len(running.lines())
        running.ctrl_c()
        held.ctrl_c()
        time.sleep(1)
        held.ctrl_c()  # within the window: stops it
        assert running.wait() == 130, running.err.read_text()[-2000:]
        assert held.wait() == 130, held.err.read_text()[-2000:]

        said = running.lines()[before:]
        shown = [ln for ln in said if not ln.startswith("20")]  # the job's own log lines
        assert len(shown) == 1, said
        head = f"detached: job {ids[0]} keeps running; see it: "
        assert shown[0].startswith(head), shown
        status, stop = shown[0].removeprefix(head).split(" (or press")[0].split("; stop it: ")
        assert shlex.split(status)[1:] == ["-m", "axonn_launch.jobs", "status", "./job"], status
        assert shlex.split(stop)[1:] == ["-m", "axonn_launch.jobs", "stop", "./job"], stop
        assert "Traceback" not in running.err.read_text() + running.out.read_text()
        assert squeue_state(ids[0]) == "RUNNING"
        row = running.copied(status)  # as the user copies it, where they launched
        assert row.returncode == 0 and "RUNNING" in row.stdout, row.stdout + row.stderr
        stopped = running.copied(stop)
        assert stopped.returncode == 0 and f"cancelled {ids[0]}" in stopped.stdout, stopped

        last = held.lines()[-1]
        assert last == f"Ctrl-C again: stopped {held.job_dir}: cancelled {ids[1]}", held.lines()
        assert "Traceback" not in held.err.read_text() + held.out.read_text()
        wait_until(lambda: squeue_state(ids[1]) in ("", "CANCELLED"), 60, "held job cancelled")
    finally:
        running.end()
        held.end()
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, timeout=30)
