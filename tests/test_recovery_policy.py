"""The recovery policy, limits, notifier and settings (``submit/chain.py``,
``submit/recovery.py``), without a cluster; ``tests/slurm/test_recovery.py`` runs them."""

from __future__ import annotations

import json
import stat
import time

import pytest

from axonn_launch.common.jobdir import write_record_file
from axonn_launch.config.compose import RecoveryConfig
from axonn_launch.records import failures
from axonn_launch.submit import chain
from axonn_launch.submit.recovery import limit_reached
from tests.conftest import run_launcher


def test_default_policy_follows_the_classes():
    settings = RecoveryConfig()
    resumed = [failures.RANK_KILLED, failures.COLLECTIVE_FAILURE, failures.PREEMPTED,
               failures.TIMEOUT]  # fmt: skip
    assert {chain.policy_of(settings, c) for c in resumed} == {chain.RESUME}
    assert chain.policy_of(settings, failures.NODE_FAILURE) == chain.RESUME_EXCLUDE
    stopped = [failures.CODE_ERROR, failures.HOST_OOM, failures.GPU_OOM, failures.UNKNOWN,
               failures.STORAGE_FULL, failures.STORAGE_ERROR, failures.CANCELLED]  # fmt: skip
    assert {chain.policy_of(settings, c) for c in stopped} == {chain.STOP}
    assert set(chain.DEFAULT_POLICY) == set(failures.CLASSES) - {"completed", "running"}
    mine = RecoveryConfig(policy={failures.CODE_ERROR: chain.RESUME})
    assert chain.policy_of(mine, failures.CODE_ERROR) == chain.RESUME


def ended(*classes: str) -> list[dict]:
    return [{"class": c} for c in classes]


def test_limits_say_which_one_stopped_the_run():
    settings = RecoveryConfig(max_attempts=4, max_same_class=2, budget_h=1.0)
    now = time.time()
    assert limit_reached(settings, ended("rank_killed", "timeout"), now) == ""
    assert limit_reached(settings, ended("timeout", "rank_killed", "rank_killed"), now) == (
        "recovery.max_same_class=2: rank_killed 2 times in a row"
    )
    four = ended("timeout", "rank_killed", "timeout", "rank_killed")
    assert limit_reached(settings, four, now) == "recovery.max_attempts=4: 4 attempts made"
    two_hours_ago = now - 7200
    assert limit_reached(settings, ended("timeout"), two_hours_ago).startswith(
        "recovery.budget_h=1: 2.00 h"
    )


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("recovery.policy.code_error=retry", "recovery.policy.code_error='retry'"),
        ("+recovery.policy.typo=stop", "recovery.policy.typo: not a failure class"),
        ("recovery.max_same_class=0", "recovery.max_same_class=0"),
        ("recovery.on_fewer_nodes=grow", "recovery.on_fewer_nodes='grow'"),
        ("recovery.mode=sometimes", "recovery.mode='sometimes'"),
    ],
)
def test_bad_recovery_settings_are_one_line_and_write_nothing(tmp_path, override, field):
    job_dir = tmp_path / "job"
    result = run_launcher(
        ["machine=slurm_local", "dry_run=true", override, f"hydra.run.dir={job_dir}"],
        cwd=tmp_path,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}"), result.stderr
    assert "valid" in lines[0] or "at least" in lines[0]
    assert not job_dir.exists()


def test_notify_runs_on_each_new_state_with_the_run_dir(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    write_record_file(root, {"job_ids": ["7"]})
    calls = tmp_path / "calls.txt"
    script = tmp_path / "notify.sh"
    script.write_text(f'#!/bin/sh\necho "$1 $2" >> {calls}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    settings = RecoveryConfig(notify=f"{script}")
    chain.set_chain(root, settings, state=chain.RECOVERING)
    chain.set_chain(root, settings, state=chain.RECOVERING, attempts=[])  # not a new state
    chain.set_chain(root, settings, state=chain.STOPPED, stop={"reason": "x"})
    assert calls.read_text().splitlines() == [f"{root} recovering", f"{root} stopped"]
    broken = RecoveryConfig(notify=str(tmp_path / "missing"))
    chain.set_chain(root, broken, state=chain.RUNNING)  # a broken notifier is recorded only
    record = json.loads((root / "job.json").read_text())
    assert record["chain"]["state"] == chain.RUNNING and "missing" in record["notify_error"]


def test_the_shipped_policy_is_the_default_policy():
    """conf/recovery/auto.yaml lists every class (so ``recovery.policy.<class>=`` needs no
    ``+``); it must say what the code's defaults say."""
    from axonn_launch.config.compose import load

    assert load([]).recovery.policy == chain.DEFAULT_POLICY
