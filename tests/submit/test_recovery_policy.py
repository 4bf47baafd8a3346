"""The recovery policy, limits, notifier and settings (``submit/chain.py``,
``batch/recovery.py``), without a cluster; ``tests/slurm/test_recovery.py`` runs them."""

from __future__ import annotations

import json
import stat
import time

import pytest

from axonn_launch.batch import recovery, resubmit
from axonn_launch.batch.recovery import limit_reached
from axonn_launch.common.jobdir import (
    JobPaths,
    skipped_steps,
    write_json_atomically,
    write_record_file,
)
from axonn_launch.config.compose import RecoveryConfig
from axonn_launch.records import failures
from axonn_launch.submit import chain
from tests.conftest import run_launcher


def test_default_policy_follows_the_classes():
    settings = RecoveryConfig()
    resumed = [failures.RANK_KILLED, failures.COLLECTIVE_FAILURE, failures.PREEMPTED,
               failures.TIMEOUT]  # fmt: skip
    assert {chain.policy_of(settings, c) for c in resumed} == {chain.RESUME}
    assert chain.policy_of(settings, failures.NODE_FAILURE) == chain.RESUME_EXCLUDE
    assert chain.policy_of(settings, failures.HANG) == chain.RESUME_EXCLUDE
    stopped = [failures.CODE_ERROR, failures.HOST_OOM, failures.GPU_OOM, failures.UNKNOWN,
               failures.STORAGE_FULL, failures.STORAGE_ERROR, failures.CANCELLED,
               failures.NON_FINITE]  # fmt: skip
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


def test_a_hang_that_repeats_counts_against_max_same_class():
    settings = RecoveryConfig(max_same_class=3, max_no_progress=9)
    assert limit_reached(settings, ended("hang", "hang"), time.time()) == ""
    assert limit_reached(settings, ended("hang", "hang", "hang"), time.time()) == (
        "recovery.max_same_class=3: hang 3 times in a row"
    )


def progressed(*saved: int | None) -> list[dict]:
    classes = ("timeout", "rank_killed", "hang")  # never 3 alike in a row
    return [{"class": classes[i % 3], "checkpointed": s} for i, s in enumerate(saved)]


@pytest.mark.parametrize(
    ("saved", "stops"),
    [
        ((0, 0), False),  # two attempts: not yet
        ((0, 0, 0), True),  # three attempts, no checkpoint at all
        ((50, 50, 50), False),  # the first one saved step 50: progress since the start
        ((50, 50, 50, 50), True),  # then three more without a newer one
        ((50, 60, 60, 60), False),
        ((50, 60, 40, 50, 60), False),  # a damaged save: back to 40, and on again
        ((50, 60, 40, 40, 40), True),
        ((None, 0, 0), False),  # an attempt recorded before this was kept: cannot tell
    ],
)
def test_a_chain_that_saves_nothing_newer_in_k_attempts_stops(saved, stops):
    settings = RecoveryConfig(max_attempts=99, max_same_class=99, max_no_progress=3)
    why = limit_reached(settings, progressed(*saved), time.time())
    assert bool(why) == stops, why
    if stops:
        assert why.startswith("recovery.max_no_progress=3: 3 attempts in a row saved no")
        assert "\n" not in why


def test_rollback_is_valid_for_non_finite_only():
    assert chain.problem(RecoveryConfig(policy={"non_finite": "rollback"})) is None
    why = chain.problem(RecoveryConfig(policy={"hang": "rollback"}))
    assert why == (
        "recovery.policy.hang='rollback': valid: resume, resume_exclude, stop"
        " (rollback is only for non_finite)"
    )
    assert chain.problem(RecoveryConfig(max_no_progress=0)).startswith(
        "recovery.max_no_progress=0: must be at least 1"
    )


def status_row(job_dir, failure: str, **more) -> object:
    """What ``collect`` gives the recovery step for a failed attempt."""
    from axonn_launch.records.status import JobStatus

    fields = dict(job_dir=str(job_dir), job_id="local-1", name="run", machine="local",
                  model="gpt_tiny", grid="", nodes=2, state="ENDED", step=9, steps=20,
                  loss=None, tokens_per_s=None, step_time_s=None, failure=failure,
                  action=failures.ACTIONS[failure], reason="", attempt=1)  # fmt: skip
    return JobStatus(**{**fields, **more})


def test_exclude_stragglers_adds_the_reports_nodes_and_turns_a_resume_into_an_exclusion(tmp_path):
    report = {"step": 300, "median_s": 0.1, "stragglers": [
        {"rank": 3, "node": "n2", "ratio": 3.1}, {"rank": 5, "node": "n3", "ratio": 2.0},
        {"rank": 6, "node": "?", "ratio": 2.0}]}  # fmt: skip
    write_json_atomically(JobPaths(tmp_path).stragglers, report)
    row = status_row(tmp_path, failures.TIMEOUT, bad_nodes=["n3"])
    off = recovery.with_stragglers(RecoveryConfig(), row, chain.RESUME, tmp_path)
    assert off == (row, chain.RESUME)
    on = RecoveryConfig(exclude_stragglers=True)
    found, action = recovery.with_stragglers(on, row, chain.RESUME, tmp_path)
    assert (found.bad_nodes, action) == (["n3", "n2"], chain.RESUME_EXCLUDE)
    assert recovery.with_stragglers(on, row, chain.STOP, tmp_path) == (row, chain.STOP)
    assert recovery.straggler_nodes(tmp_path / "none") == []


def test_a_hang_without_suspects_resumes_with_an_empty_exclusion(tmp_path):
    """The resubmission's overrides gain no --exclude (and keep an earlier one)."""
    old = ["machine=slurm_local", "grid.x=2"]
    assert resubmit.new_overrides(old, [], ()) == [*old, "wait=false"]
    earlier = [*old, f"{resubmit.EXCLUDE_KEY}=n9"]
    assert resubmit.new_overrides(earlier, [], ())[-2:] == [f"{resubmit.EXCLUDE_KEY}=n9",
                                                            "wait=false"]  # fmt: skip
    write_record_file(tmp_path, {"command_line": ["axonn_launch", *old]})
    assert recovery.exclusion(tmp_path, {"command_line": ["x", *old]}, [], None) == ([], [])
    named = resubmit.new_overrides(old, [], ("n2",))
    assert named[-2:] == [f"{resubmit.EXCLUDE_KEY}=n2", "wait=false"]


def failed_attempt(tmp_path, failure_record: dict, latest: int = 4, attempts=()) -> object:
    """A failed local attempt with recovery on (its run's own root), whose ranks left
    ``failure_record``; the run's chain holds ``attempts`` already."""
    job_dir = tmp_path / "run"
    JobPaths(job_dir).failures.mkdir(parents=True)
    (JobPaths(job_dir).failures / "rank_0.json").write_text(json.dumps(failure_record))
    JobPaths(job_dir).step(f"step_{latest}").mkdir(parents=True)
    JobPaths(job_dir).latest.write_text(f"step_{latest}")
    settings = {"mode": "on", "policy": {"non_finite": "rollback"}, "backoff_s": 0}
    write_record_file(job_dir, {
        "name": "run", "job_ids": ["local-999999999"], "machine": "local", "scheduler": "local",
        "nodes": 1, "tasks_per_node": 2, "steps": 20, "status": "failed", "exit_code": 1,
        "submit_time": "2026-12-04T10:00:00+0000", "recovery": settings,
        "chain": {"state": "running", "attempts": list(attempts)}})  # fmt: skip
    return job_dir


NON_FINITE_RECORD = {"rank": 0, "host": "h", "time": 1.9e9, "failure_class": "non_finite",
                     "step": 7, "first": "loss", "tail": [],
                     "exception": "NonFiniteError: non-finite loss at step 7 (gradients not"
                     " finite); the step was not applied"}  # fmt: skip


def test_rollback_skips_the_step_once_and_the_next_attempt_holds_it(tmp_path, monkeypatch):
    job_dir = failed_attempt(tmp_path, NON_FINITE_RECORD)
    target = tmp_path / "run_attempt2"

    def resubmitted(status, args, out):  # the resubmission, as batch/resubmit.py makes it
        assert status.failure == failures.NON_FINITE and status.detail["step"] == 7
        target.mkdir()
        write_record_file(job_dir, {**json.loads(JobPaths(job_dir).record.read_text()),
                                    "resubmitted_as": str(target)})  # fmt: skip
        return f"resubmitted local-999999999 (non_finite) as job local-2 in {target}"

    monkeypatch.setattr(recovery, "resubmit_one", resubmitted)
    line = recovery.recover(job_dir)
    assert line.startswith("resubmitted"), line
    assert skipped_steps(job_dir) == [7] and skipped_steps(target) == [7]
    chain_record = json.loads(JobPaths(job_dir).record.read_text())["chain"]
    (attempt,) = chain_record["attempts"]
    assert attempt["action"] == chain.ROLLBACK and attempt["failed_step"] == 7
    assert attempt["checkpointed"] == 4 and chain_record["state"] == chain.RUNNING


def test_a_second_non_finite_at_the_same_step_stops(tmp_path, monkeypatch):
    before = {"class": "non_finite", "action": "rollback", "failed_step": 7, "checkpointed": 4}
    job_dir = failed_attempt(tmp_path, NON_FINITE_RECORD, attempts=[before])
    monkeypatch.setattr(recovery, "resubmit_one", lambda *a: pytest.fail("resubmitted"))
    line = recovery.recover(job_dir)
    assert line.endswith(
        "stop: non_finite at step 7 again after a rollback past it (once per step)"
    )
    assert json.loads(JobPaths(job_dir).record.read_text())["chain"]["state"] == chain.STOPPED


def test_no_rollback_past_a_checkpoint_at_or_after_the_step(tmp_path, monkeypatch):
    job_dir = failed_attempt(tmp_path, NON_FINITE_RECORD, latest=7)
    monkeypatch.setattr(recovery, "resubmit_one", lambda *a: pytest.fail("resubmitted"))
    assert recovery.recover(job_dir).endswith(
        "stop: non_finite at step 7: the newest checkpoint (step 7) is not older"
    )
    assert skipped_steps(job_dir) == []


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


def test_a_node_the_user_left_out_stays_out_when_a_failed_node_is_readmitted(tmp_path):
    """The run's own ``--exclude`` is the user's choice, not a failure's: a resume keeps it
    even though the node is up (a chained resubmission once landed on the n1 it left out)."""
    line = ["axonn_launch", "machine=slurm_local", f"{resubmit.EXCLUDE_KEY}='n1,n3'"]
    record = {"command_line": line}
    up = ["n1", "n2", "n3", "n4"]  # n3 failed before and is back in service
    assert recovery.exclusion(tmp_path, record, [], up, by_user=("n1",)) == (
        ["n1"],
        [f"{resubmit.EXCLUDE_KEY}=n1"],
    )
    readmitted = recovery.exclusion(tmp_path, record, [], up)  # without it: n1 is used again
    assert readmitted == ([], [f"{resubmit.EXCLUDE_KEY}="])


def decision_recorded(job_dir, failure: str, action: str) -> dict:
    """What the restart decision records in the run's chain for the job's ended step (its
    own functions), when it hands the failure over to the chain."""
    from axonn_launch.batch import restart
    from axonn_launch.records.evidence import EndedStep

    record = json.loads(JobPaths(job_dir).record.read_text())
    ended = EndedStep("local-999999999", 1, ("n2",), 2, time.time())
    diagnosis = failures.Diagnosis(failure, f"{failure} at step 7", ("n2",), {"step": 7})
    attempt = restart.attempt_of(job_dir, ended, diagnosis, action)
    attempt[recovery.FAILURE_KEY] = recovery.failure_key(ended.job_id, record)
    restart.record_attempt(job_dir, record, attempt, "1 of the 2 nodes left: the chain")
    return attempt


def test_the_recovery_step_completes_the_decisions_entry_for_the_same_failure(
    tmp_path, monkeypatch
):
    """One failure, one record: the decision's entry and the recovery job's share the key
    ``<job id>.<step>``; the recovery job's verdict lands in that entry."""
    job_dir = failed_attempt(tmp_path, NON_FINITE_RECORD)
    decided = decision_recorded(job_dir, failures.NON_FINITE, chain.ROLLBACK)
    assert decided[recovery.FAILURE_KEY] == "local-999999999.0"
    target = tmp_path / "run_attempt2"

    def resubmitted(status, args, out):
        target.mkdir()
        write_record_file(job_dir, {**json.loads(JobPaths(job_dir).record.read_text()),
                                    "resubmitted_as": str(target)})  # fmt: skip
        return f"resubmitted local-999999999 as job local-2 in {target}"

    monkeypatch.setattr(recovery, "resubmit_one", resubmitted)
    assert recovery.recover(job_dir).startswith("resubmitted")
    (attempt,) = json.loads(JobPaths(job_dir).record.read_text())["chain"]["attempts"]
    assert attempt["in_place"] and attempt["by_chain"] and not attempt["restarted"], attempt
    assert attempt["nodes"] == ["n2"] and attempt["action"] == chain.ROLLBACK, attempt


def test_max_same_class_counts_distinct_failures():
    """Two entries of one failure (an older run's records) count once."""
    settings = RecoveryConfig(max_same_class=3, max_no_progress=9)
    keyed = [{"class": "node_failure", "failure_key": k} for k in ("9.0", "9.1", "9.1")]
    assert limit_reached(settings, keyed, time.time()) == ""
    keyed.append({"class": "node_failure", "failure_key": "10.0"})
    assert limit_reached(settings, keyed, time.time()) == (
        "recovery.max_same_class=3: node_failure 3 times in a row"
    )
