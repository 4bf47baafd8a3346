"""``jobs stop`` and ``jobs resubmit`` of the same failed run, as two real processes at
once: whichever comes second sees the first (stop takes the lock a resubmission holds while
it launches, ``submit/chain.py``'s ``newest_attempt_locked``). The run ends stopped with no
attempt left running, or resubmitted and not stopped; never a new attempt running inside a
run that says stopped. One failed 1-rank local run (rank 0 killed after step 3), copied
for each race; the new attempt's steps take 2 s, so that it is still running when looked
at. Over 60 s: four races of real launches on two loaded cores."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import RESUBMIT_LOCK, read_record, read_record_or_empty
from axonn_launch.scheduler import processes
from axonn_launch.submit import chain
from tests.conftest import run_launcher
from tests.submit.test_local_supervisor import poll, reap  # noqa: F401 (a fixture)

RUN = ["machine=local", "model=gpt_tiny", "grid.x=1", "train.steps=12",
       "train.checkpoint_every=2", "train.warmup_steps=0", "train.sample_tokens=0",
       "train.progress=false", "train.gemm_tuning=false", "train.eval_batches=0"]  # fmt: skip
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap")]


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("failed") / "run"
    done = run_launcher([*RUN, "recovery=off", f"hydra.run.dir={root}"], cwd=root.parent,
                        env={"AXONN_FAULT": "kill@step3:rank0"}, timeout=300)  # fmt: skip
    assert done.returncode != 0 and read_record(root)["status"] == "failed", done.stderr[-2000:]
    return root


def jobs_cli(verb: str, root: Path) -> subprocess.Popen:
    env = {**os.environ, "AXONN_FAULT": "slow@step1:2:attempt2"}  # the new attempt: 2 s a step
    return subprocess.Popen([sys.executable, "-m", "axonn_launch.jobs", verb, str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=root.parent)  # fmt: skip


def lock_held(root: Path) -> bool:
    """Whether a process holds ``root``'s resubmission lock now."""
    with open(root / RESUBMIT_LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def race(failed: Path, folder: Path, first: str, head_start: str) -> tuple[str, bool]:
    """``first`` (stop or resubmit) starts, then the other once ``head_start`` says
    (``lock``: the resubmission holds its lock; ``exit``: the first ended; ``0``: at once);
    both must exit 0. The run's state then, and whether its new attempt was launched."""
    root = folder / "run"
    shutil.copytree(failed, root)
    second = "stop" if first == "resubmit" else "resubmit"
    one = jobs_cli(first, root)
    if head_start == "lock":
        poll(lambda: lock_held(root), 120, f"jobs {first} holding the lock")
    if head_start == "exit":
        one.wait(timeout=300)
    two = jobs_cli(second, root)
    outs = {first: one.communicate(timeout=300)[0], second: two.communicate(timeout=300)[0]}
    assert one.returncode == 0 and two.returncode == 0, outs
    return chain.run_state(root), len(chain.launched_attempts(root)) > 1


def new_attempt_running(root: Path) -> bool:
    return bool(processes.live_supervisors(chain.launched_attempts(root)[1:]))


@pytest.mark.parametrize(
    ("first", "head_start"),
    [("resubmit", "lock"), ("stop", "exit"), ("stop", "0"), ("resubmit", "0")],
)
def test_stop_racing_resubmit_ends_stopped_or_resubmitted_never_both(
    failed_run, tmp_path, first, head_start
):
    state, launched = race(failed_run, tmp_path, first, head_start)
    root = tmp_path / "run"
    if head_start == "lock":  # stop came second, while the resubmission launched: it saw it
        assert (state, launched) == (chain.STOPPED, True)
    if head_start == "exit":  # the resubmission came second: it started the run again
        assert (state, launched) == (chain.RUNNING, True)
    if state == chain.STOPPED:  # nothing left running, and nothing finished the training
        poll(lambda: not new_attempt_running(root), 120, "the new attempt's supervisor ended")
        newest = read_record_or_empty(chain.launched_attempts(root)[-1])
        assert newest.get("status") != "completed", newest
        return
    assert launched and state == chain.RUNNING, (state, read_record(root).get("chain"))
    assert new_attempt_running(root) and not chain.chain_of(root).get("stopped_by_user")
    said = subprocess.run([sys.executable, "-m", "axonn_launch.jobs", "stop", str(root)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert said.returncode == 0, said.stdout + said.stderr
    poll(lambda: not new_attempt_running(root), 120, "the new attempt stopped")
