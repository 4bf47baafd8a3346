"""A rank's own diagnosis (records/failures.py): the watchdog's hang and the non-finite guard's
failure records decide the class before the symptoms in the logs, with the nodes to leave
out; ``jobs status`` shows where a hang stopped, its stacks and the stragglers
(records/status.py). Records and logs are written here as the job side writes them
(common/jobdir.record_failure, train/health/watchdog.py's line); nothing is launched."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import JobPaths, write_json_atomically
from axonn_launch.records import failures, status
from axonn_launch.records.failures import Evidence, classify
from axonn_launch.scheduler import slurm_queries

# as torch's gloo and NCCL print them (tests/records/test_failures.py has more)
GLOO_PEER_CLOSED = (
    "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection"
    " closed by peer [127.0.0.1]:47015"
)
NCCL_ERROR = (
    "[rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356,"
    " unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5"
)
WATCHDOG = (
    "[rank3]:[E1129 10:02:11.123 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective"
    " operation timeout: WorkNCCL(SeqNum=9021, OpType=ALLREDUCE, NumelIn=1, Timeout(ms)=600000)"
    " ran for 600012 milliseconds before timing out."
)

NODES = ("n1", "n2")
STACKS = "/scratch/job/logs/stacks"


def hang_record(rank: int = 1, *, suspects=(), time: float = 100.0, **more) -> dict:
    """What a rank's watchdog writes (train/health/watchdog.py, through record_failure)."""
    named = ", ".join(f"rank {s['rank']} ({s['node']}), silent" for s in suspects) or "none named"
    line = (
        f"axonn_launch watchdog: hang: rank {rank} (n1) saw no progress in section compute of"
        f" step 113 for 45 s (deadline 40 s); without progress: {named}; stacks in {STACKS}"
    )
    return {"rank": rank, "host": "n1.cluster", "time": time, "exception": f"Hang: {line}",
            "tail": [f"axonn_launch.train.health.watchdog.Hang: {line}"], "failure_class": "hang",
            "section": "compute", "step": 113, "stalled_s": 45.0, "deadline_s": 40.0,
            "suspects": list(suspects), "stacks": STACKS, **more}  # fmt: skip


def non_finite_record(rank: int, first: str = "gradients", time: float = 100.0) -> dict:
    said = f"non-finite {first} at step 7 (loss finite); the step was not applied"
    return {"rank": rank, "host": f"n{rank + 1}", "time": time,
            "exception": f"NonFiniteError: {said}", "tail": [f"NonFiniteError: {said}"],
            "failure_class": "non_finite", "step": 7, "first": first}  # fmt: skip


def evidence(*records: dict, logs: dict[int, str] | None = None, **more) -> Evidence:
    """A failed Slurm job of 4 ranks on n1, n2 whose peers lost their connections."""
    logs = logs if logs is not None else {r: GLOO_PEER_CLOSED for r in range(4)}
    texts = tuple(r["exception"] for r in records)
    return Evidence(state="FAILED", exit_code="75:0", logs=logs, nodes=NODES, tasks_per_node=2,
                    records=texts, failure_records=records, **more)  # fmt: skip


def test_a_hang_record_beats_the_peers_symptoms_and_names_the_suspects_nodes():
    suspects = [{"rank": 2, "node": "n2"}, {"rank": 3, "node": "n2"}]
    logs = {0: GLOO_PEER_CLOSED, 1: WATCHDOG, 2: NCCL_ERROR, 3: GLOO_PEER_CLOSED}
    diagnosis = classify(evidence(hang_record(suspects=suspects), logs=logs))
    assert (diagnosis.failure, diagnosis.bad_nodes) == (failures.HANG, ("n2",))
    assert diagnosis.action == failures.RESUME_EXCLUDING
    assert diagnosis.detail["section"] == "compute" and diagnosis.detail["step"] == 113
    assert diagnosis.detail["stacks"] == STACKS and diagnosis.detail["node"] == "n1"
    assert diagnosis.reason == (
        "section compute of step 113 hung: no progress for 45 s; without progress:"
        f" rank 2 (n2), rank 3 (n2); stacks in {STACKS}"
    )


def test_a_hang_that_names_no_rank_is_a_plain_resume():
    diagnosis = classify(evidence(hang_record()))
    assert (diagnosis.failure, diagnosis.bad_nodes) == (failures.HANG, ())
    assert "no rank named" in diagnosis.reason


def test_a_suspect_the_watchdog_could_not_place_is_placed_by_its_rank():
    """A silent rank whose heartbeat never came is named with node "?": its task's place
    in the allocation gives the node; a node outside the allocation is never excluded."""
    suspects = [{"rank": 3, "node": "?"}, {"rank": 0, "node": "elsewhere"}]
    diagnosis = classify(evidence(hang_record(suspects=suspects)))
    assert diagnosis.bad_nodes == ("n2",)


def test_every_watchdog_record_counts_and_the_earliest_says_where():
    late = hang_record(2, suspects=[{"rank": 0, "node": "n1"}], time=103.0, section="sync")
    early = hang_record(1, suspects=[{"rank": 3, "node": "n2"}], time=101.0)
    diagnosis = classify(evidence(late, early))
    assert diagnosis.detail["section"] == "compute" and diagnosis.detail["rank"] == 1
    assert diagnosis.bad_nodes == ("n2", "n1")


def test_a_hang_with_no_suspect_is_a_plain_resume_and_one_with_a_suspect_excludes_it():
    """docs/recovery.md: a hang whose watchdogs named no rank resumes without leaving out
    any node (the action printed says so, not ``resume_exclude``)."""
    nobody = classify(evidence(hang_record(suspects=[])))
    assert (nobody.failure, nobody.bad_nodes, nobody.action) == (failures.HANG, (), "resume")
    named = classify(evidence(hang_record(suspects=[{"rank": 3, "node": "n2"}])))
    assert (named.bad_nodes, named.action) == (("n2",), "resume_exclude")


def test_storage_and_gpu_faults_still_come_first():
    disk = {"rank": 0, "host": "n1", "time": 90.0, "exception": "OSError: [Errno 28] No space"
            " left on device: '/scratch/job/checkpoints/.tmp_step_100/__0_0.distcp'"}  # fmt: skip
    hang = hang_record(suspects=[{"rank": 0, "node": "n1"}])
    assert classify(evidence(disk, hang)).failure == failures.STORAGE_FULL
    xid = {0: "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus."}
    diagnosis = classify(evidence(hang, logs={**xid, 1: GLOO_PEER_CLOSED}))
    assert (diagnosis.failure, diagnosis.bad_nodes) == (failures.NODE_FAILURE, ("n1",))


def test_a_rank_that_died_of_an_error_before_the_hang_is_the_cause():
    """Its peers waited for it until their watchdog fired: the error decides, not the hang."""
    crashed = {
        "rank": 2,
        "host": "n2",
        "time": 50.0,
        "exception": "ValueError: bad shard",
        "tail": ["Traceback (most recent call last):", "ValueError: bad shard"],
    }
    diagnosis = classify(evidence(crashed, hang_record(suspects=[{"rank": 2, "node": "n2"}])))
    assert (diagnosis.failure, diagnosis.reason) == (failures.CODE_ERROR, "ValueError: bad shard")
    exited = {**crashed, "exception": "SystemExit: 75", "tail": ["SystemExit: 75"]}
    assert classify(evidence(exited, hang_record())).failure == failures.HANG


def test_a_non_finite_record_names_the_step_and_what_went_bad_first():
    records = [non_finite_record(r) for r in range(4)]
    diagnosis = classify(evidence(*records))
    assert (diagnosis.failure, diagnosis.action) == (failures.NON_FINITE, failures.STOP)
    assert diagnosis.detail == {"step": 7, "first": "gradients"} and diagnosis.bad_nodes == ()
    assert diagnosis.reason.startswith("non-finite gradients at step 7 (loss finite)")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("axonn_launch: non_finite: non-finite loss at step 3 (gradients not finite); the step"
         " was not applied", {"step": 3, "first": "loss"}),
        ("[rank0]: axonn_launch.train.loop.NonFiniteError: non-finite gradients at step 12"
         " (loss finite); the step was not applied", {"step": 12, "first": "gradients"}),
    ],
)  # fmt: skip
def test_without_records_the_guards_lines_say_it(text, expected):
    """The NonFiniteError traceback is the guard's, never a code error."""
    diagnosis = classify(evidence(logs={0: text, 1: GLOO_PEER_CLOSED}))
    assert diagnosis.failure == failures.NON_FINITE and diagnosis.detail == expected


def test_without_records_the_watchdogs_line_names_the_ranks_and_their_nodes():
    line = (
        "2026-12-04 10:00:00 ERROR axonn_launch watchdog: hang: rank 0 (n1) saw no progress in"
        " section checkpoint of step 40 for 130 s (deadline 120 s); without progress: rank 3"
        " (n2) in section compute of step 40, rank 2 (?), silent; stacks in /j/logs/stacks"
    )
    diagnosis = classify(evidence(logs={0: line, 1: GLOO_PEER_CLOSED, 2: WATCHDOG}))
    assert (diagnosis.failure, diagnosis.bad_nodes) == (failures.HANG, ("n2",))
    assert diagnosis.detail["section"] == "checkpoint" and diagnosis.detail["step"] == 40
    assert diagnosis.detail["stacks"] == "/j/logs/stacks"
    assert [s["rank"] for s in diagnosis.detail["suspects"]] == [3, 2]
    silent = line.replace("rank 3 (n2) in section compute of step 40, rank 2 (?), silent", "none")
    assert classify(evidence(logs={0: silent})).bad_nodes == ()


# --- jobs status --------------------------------------------------------------------------


def local_job(tmp_path: Path, *records: dict) -> tuple[Path, dict]:
    """A failed local attempt (no scheduler asked) with these failure records."""
    job_dir = tmp_path / "job"
    record = {"name": "job", "job_ids": ["local-999999999"], "machine": "local",
              "scheduler": "local", "nodes": 1, "tasks_per_node": 4, "steps": 200,
              "status": "failed", "exit_code": 75, "submit_time": "2026-12-04T10:00:00+0000",
              "ended_by": {"rank": 1, "returncode": 75, "line": "rank 1 exited"}}  # fmt: skip
    JobPaths(job_dir).failures.mkdir(parents=True)
    for found in records:
        (JobPaths(job_dir).failures / f"rank_{found['rank']}.json").write_text(json.dumps(found))
    (job_dir / "job.json").write_text(json.dumps(record))
    return job_dir, record


def test_status_shows_where_a_local_run_hung_and_leaves_out_no_node(tmp_path):
    stamp = datetime.fromisoformat("2026-12-04T10:10:00+00:00").timestamp()  # after the submit
    suspect = [{"rank": 2, "node": "laptop"}]
    job_dir, record = local_job(tmp_path, hang_record(suspects=suspect, time=stamp))
    row = status.job_status(job_dir, record, None, None)
    # one computer: nothing to leave out, so the action is a plain resume
    assert (row.failure, row.action) == (failures.HANG, failures.RESUME)
    assert row.bad_nodes == []
    assert "section compute of step 113" in row.reason and "rank 2 (laptop)" in row.reason
    assert row.reason.endswith(f"stacks in {STACKS}") and row.detail["suspects"] == suspect


def test_status_names_the_stragglers_also_while_the_job_runs(tmp_path):
    job_dir, record = local_job(tmp_path)
    record = {**record, "status": "running", "job_ids": ["local-1"]}  # pid 1 is not ours
    report = {"step": 300, "median_s": 0.14, "stragglers": [
        {"rank": 3, "node": "n2", "compute_s": 0.34, "ratio": 2.43, "score": 31.0}]}  # fmt: skip
    write_json_atomically(JobPaths(job_dir).stragglers, report)
    row = status.job_status(job_dir, record, slurm_queries.SchedulerInfo("RUNNING"), None)
    assert row.stragglers == report["stragglers"] and row.straggler_step == 300
    assert (
        status.straggler_line(row) == "stragglers at step 300: rank 3 (n2) 2.4x the median own work"
    )
    assert status.straggler_line(status.job_status(tmp_path, {}, None, None)) == ""


SACCT_REQUEUED = """\
701|REQUEUED|0:0|n1|2026-12-04T10:00:00|2026-12-04T10:00:05|2026-12-04T10:30:05
701|REQUEUED|0:0|n2|2026-12-04T10:30:05|2026-12-04T10:32:00|2026-12-04T11:02:00
701|FAILED|75:0|n1|2026-12-04T11:02:00|2026-12-04T11:03:00|2026-12-04T11:10:00
702|RUNNING|0:0|n1|2026-12-04T11:00:00|2026-12-04T11:00:01|Unknown
"""


def submit_time(stamp: float) -> str:
    """job.json's ``submit_time`` (sacct's times are the local time zone's)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(stamp))


def test_sacct_duplicates_give_every_allocation_and_the_newest_state():
    infos = slurm_queries.sacct_infos(SACCT_REQUEUED)
    assert (infos["701"].state, infos["701"].exit_code) == ("FAILED", "75:0")
    assert len(infos["701"].allocations) == 3
    assert infos["701"].allocations[-1] == infos["701"].times
    assert infos["702"].state == "RUNNING" and infos["702"].allocations == ()
    first = infos["701"].allocations[0][0]
    record = {"job_ids": ["701"], "submit_time": submit_time(first - 1)}
    assert len(status.allocations_of(record, infos["701"])) == 3
    newer = {**record, "submit_time": submit_time(first + 3600)}  # a later job of that id
    assert status.allocations_of(newer, infos["701"]) == [list(infos["701"].times)]
