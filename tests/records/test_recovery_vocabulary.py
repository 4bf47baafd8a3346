"""One recovery-action vocabulary: ``jobs status`` says, for every failure class, what the
chain then does (``batch/recovery.py``'s ``recover``, which records its action in the
run's ``chain.attempts``), and without a chain what ``jobs resubmit`` does; both read the
one table, ``records/failures.py``'s ``RECOVERY``. Login-node only: no ranks run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from axonn_launch import jobs
from axonn_launch.batch import recovery
from axonn_launch.common.jobdir import JobPaths, write_json_atomically, write_record_file
from axonn_launch.records import failures, status
from axonn_launch.records.failures import Diagnosis

NODE = "n2"  # the node a class that excludes nodes names


def failed_attempt(root: Path, settings: dict | None) -> Path:
    """A failed local attempt; with ``settings``, a run its chain recovers."""
    job_dir = root / "run"
    job_dir.mkdir(parents=True)
    record = {
        "name": "run", "job_ids": ["local-999999999"], "machine": "local", "scheduler": "local",
        "nodes": 1, "tasks_per_node": 2, "steps": 20, "status": "failed", "exit_code": 1,
        "submit_time": "2026-12-04T10:00:00+0000",
    }  # fmt: skip
    if settings is not None:
        record |= {"recovery": {"mode": "on", "backoff_s": 0, **settings},
                   "chain": {"state": "running", "attempts": []}}  # fmt: skip
    write_record_file(job_dir, record)
    return job_dir


@pytest.fixture
def diagnosed(monkeypatch):
    """Make every job diagnose as the class ``diagnosed.failure`` (with a bad node)."""

    class Chosen:
        failure = failures.UNKNOWN

    def diagnose(job_dir, record, info, preflight):
        return "ENDED", Diagnosis(Chosen.failure, "planted", (NODE,))

    monkeypatch.setattr(status, "diagnose", diagnose)
    monkeypatch.setattr(recovery, "resubmit_one", lambda *a: "resubmitted (not really)")
    return Chosen


def status_action(job_dir: Path, capsys) -> str:
    """The action ``jobs status`` gives the job."""
    capsys.readouterr()
    assert jobs.main(["status", str(job_dir), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    return row["action"]


def chain_action(job_dir: Path) -> str:
    """The action the chain's recovery step takes for the job, as it records it."""
    recovery.recover(job_dir)
    (attempt,) = json.loads(JobPaths(job_dir).record.read_text())["chain"]["attempts"]
    return attempt["action"]


POLICIES = {
    "default": {},
    "overridden": {
        "policy": {
            "cancelled": "resume",
            "collective_failure": "resume_exclude",
            "non_finite": "rollback",
            "code_error": "resume",
        }
    },  # fmt: skip
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("failure", list(failures.CHAIN_POLICY))
def test_jobs_status_says_what_the_chain_does(tmp_path, capsys, diagnosed, failure, policy):
    diagnosed.failure = failure
    job_dir = failed_attempt(tmp_path, POLICIES[policy])
    said = status_action(job_dir, capsys)
    assert said == chain_action(job_dir), (failure, policy)


def test_a_resume_that_leaves_out_stragglers_says_so(tmp_path, capsys, diagnosed):
    diagnosed.failure = failures.TIMEOUT
    job_dir = failed_attempt(tmp_path, {"exclude_stragglers": True})
    report = {"step": 30, "stragglers": [{"rank": 1, "node": "n3", "ratio": 2.5}]}
    write_json_atomically(JobPaths(job_dir).stragglers, report)
    said = status_action(job_dir, capsys)
    assert said == chain_action(job_dir) == failures.RESUME_EXCLUDING


@pytest.mark.parametrize("failure", list(failures.RECOVERY))
def test_without_a_chain_jobs_status_says_what_resubmit_does(tmp_path, capsys, diagnosed, failure):
    """No chain (recovery off), or a chain that stopped: a person decides (``jobs resubmit``)."""
    diagnosed.failure = failure
    alone = failed_attempt(tmp_path / "alone", None)
    assert status_action(alone, capsys) == failures.RECOVERY[failure].by_hand
    stopped = failed_attempt(tmp_path / "stopped", {})
    record = json.loads(JobPaths(stopped).record.read_text())
    write_record_file(stopped, {**record, "chain": {"state": "stopped", "attempts": []}})
    assert status_action(stopped, capsys) == failures.RECOVERY[failure].by_hand


def test_the_shipped_policy_is_the_tables_chain_column():
    """conf/recovery/auto.yaml lists every class the chain acts on, as the table says."""
    shipped = Path(failures.__file__).parents[1] / "conf" / "recovery" / "auto.yaml"
    policy = yaml.safe_load(shipped.read_text())["policy"]
    assert policy == failures.CHAIN_POLICY
    assert set(failures.RECOVERY) == set(failures.CLASSES)
    words = {failures.NONE, failures.WAIT, failures.RESUME, failures.RESUME_EXCLUDING,
             failures.ROLLBACK, failures.STOP, failures.RETRY_WITH_NEW_GRID,
             failures.DO_NOT_RETRY, failures.REPORT}  # fmt: skip
    assert {a for r in failures.RECOVERY.values() for a in r} <= words
