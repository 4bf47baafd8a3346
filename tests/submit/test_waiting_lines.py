"""What a user sees while waiting: a followed job's queue lines, and a site submission on a
computer without Slurm (one line, nothing written)."""

from __future__ import annotations

import io
import os
import sys

from axonn_launch.scheduler.slurm_jobs import QueueLines
from tests.conftest import run_launcher
from tests.submit.test_slurm_follow import VirtualClock, checks_over


def queue_lines(states: dict[float, str], reasons: dict[float, str]) -> list[str]:
    """The lines printed when sacct gives ``states`` (from that time on) at follow()'s
    check times over ten minutes, squeue giving ``reasons`` (from that time on)."""
    clock, out = VirtualClock(), io.StringIO()

    def at(table: dict[float, str]) -> str:
        return table[max(t for t in table if t <= clock.now)]

    lines = QueueLines("7", clock, out, reason=lambda job_id: at(reasons))
    for check in checks_over(600):
        clock.now = check
        lines.seen(at(states))
    return out.getvalue().splitlines()


def test_a_pending_job_says_why_at_once_then_about_once_a_minute_then_when_it_starts():
    said = queue_lines({0: "PENDING", 300: "RUNNING"}, {0: "Priority"})
    assert said == [
        "job 7 pending (Priority): 0 s in the queue so far",
        "job 7 pending (Priority): 63 s in the queue so far",
        "job 7 pending (Priority): 2 min in the queue so far",
        "job 7 pending (Priority): 3 min in the queue so far",
        "job 7 pending (Priority): 4 min in the queue so far",
        "job 7 running after 5 min queued",
    ]


def test_a_job_the_scheduler_has_not_looked_at_yet_waits_a_few_seconds_to_say_so():
    # squeue's "None" before the first scheduling pass: most such jobs start at once
    assert queue_lines({0: "PENDING", 2: "RUNNING"}, {0: "None"}) == []
    said = queue_lines({0: "PENDING", 100: "RUNNING"}, {0: "None", 5: "Resources"})
    assert said[0] == "job 7 pending (Resources): 7 s in the queue so far", said
    assert said[-1] == "job 7 running after 2 min queued" and len(said) == 3, said


def test_a_site_submission_without_slurm_on_path_is_one_line_and_leaves_nothing(tmp_path):
    bindir = tmp_path / "bin"  # this Python, and no Slurm command
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    job_dir = tmp_path / "job"
    result = run_launcher(["machine=slurm_local", f"hydra.run.dir={job_dir}"], cwd=tmp_path,
                          env={"PATH": str(bindir)})  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    assert lines[0].startswith("error: machine=slurm_local submits to Slurm, but sbatch and srun")
    for way_out in ("dry_run=true", "machine=local", "rehearse=true"):
        assert way_out in lines[0], lines[0]
    assert not job_dir.exists() and result.stdout == ""
