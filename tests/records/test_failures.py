"""Failure classification on literal sacct/log texts, ``jobs status`` on synthetic job
directories (with and without accounting), resubmission decisions, fault-injection
parsing, and checkpoints that survive a rank killed while writing them."""

from __future__ import annotations

import json
import os
import pickle
import signal
from pathlib import Path

import pytest

from axonn_launch import jobs
from axonn_launch.batch import resubmit
from axonn_launch.records import failures, status
from axonn_launch.records.failures import Diagnosis, Evidence, classify
from axonn_launch.scheduler import slurm_queries
from axonn_launch.train.health import faults
from tests import fake_slurm

# --- literal texts, as Slurm, submitit, torch and the kernel write them ---------------------

GLOO_PEER_CLOSED = (
    "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
    " Connection closed by peer [127.0.0.1]:47015. This is typically caused by a remote worker"
    " crashing. Check the logs of the remote worker before reporting an error."
)
SRUN_TERMINATED = (
    "srun: error: n1: task 1: Exited with exit code 1\n"
    "srun: launch/slurm: _step_signal: Terminating StepId=53.0\n"
    "slurmstepd-n1: error: *** STEP 53.0 ON n1 CANCELLED AT 2026-11-29T15:51:05 ***\n"
    "srun: error: n1: task 0: Terminated\n"
)
NCCL_ERROR = (
    "[rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356,"
    " unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
    "[rank1]: ncclSystemError: System call (e.g. socket, malloc) or external library call failed"
)
WATCHDOG = (
    "[rank3]:[E1129 10:02:11.123 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective"
    " operation timeout: WorkNCCL(SeqNum=9021, OpType=ALLREDUCE, NumelIn=1, Timeout(ms)=600000)"
    " ran for 600012 milliseconds before timing out."
)
RCCL_ERROR = "RuntimeError: RCCL error in: ProcessGroupNCCL.cpp:1269, remote process exited"
CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total"
    " capacity of 79.15 GiB of which 1.06 GiB is free."
)
HIP_OOM = "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 1.50 GiB. GPU 3 has a"
HOST_OOM = (
    "slurmstepd: error: Detected 1 oom_kill event in StepId=812.0. Some of the step tasks have"
    " been OOM Killed."
)
TIME_LIMIT = (
    "slurmstepd: error: *** JOB 77 ON n1 CANCELLED AT 2026-11-29T10:00:00 DUE TO TIME LIMIT ***"
)
SUBMITIT_TIMEOUT = (
    "submitit.core.utils.UncompletedJobError: Job not requeued because: timed-out too many times."
)
PREEMPTION = (
    "slurmstepd: error: *** JOB 80 ON n2 CANCELLED AT 2026-11-29T10:00:00 DUE TO PREEMPTION ***"
)
NODE_FAIL_LOG = "srun: error: Node failure on n2\nsrun: error: Nodes n2 are still not responding"
KILLED = (
    "srun: error: n1: task 1: Killed\n"
    "srun: launch/slurm: _step_signal: Terminating StepId=55.0\n"
    "srun: error: n2: tasks 2-3: Killed\n"
)
# the batch script's srun killed with SIGKILL (seen on the local cluster)
SRUN_KILLED = (
    "/var/lib/axonn-slurm/slurmd-n1/job00040/slurm_script: line 21: 19648 Killed"
    "                  srun --unbuffered --kill-on-bad-exit=1 python -u -m submitit.core._submit\n"
    "slurmstepd-n1: error: *** STEP 40.0 ON n1 CANCELLED AT 2026-12-01T21:52:33 ***\n"
)
# the step's slurmstepd killed: srun loses it, the job ends COMPLETED 0:0
STEPD_KILLED = (
    "srun: error: _server_write write failed: Bad file descriptor\n"
    "srun: error: Aborting, io error and missing step on node 0\n"
    "srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\n"
)
VALUE_ERROR = (
    "Traceback (most recent call last):\n"
    '  File "/work/main/axonn_launch/train/__init__.py", line 60, in run\n'
    "ValueError: seq_len=128 > model max_seq_len=64\n"
)
SCANCEL = "slurmstepd-n1: error: *** JOB 34 ON n1 CANCELLED AT 2026-11-29T15:40:01 ***"
# train/health/watchdog.py's line, and train/loop.py's non-finite guard (its log line, its error)
HANG_LINE = (
    "axonn_launch watchdog: hang: rank 1 (n1) saw no progress in section step of step 113 for"
    " 45 s (deadline 40 s); without progress: rank 2 (n2), silent; stacks in"
    " /scratch/job/logs/stacks"
)
NON_FINITE = (
    "ERROR axonn_launch: non_finite: non-finite gradients at step 7 (loss finite); the step was"
    " not applied and nothing was saved at or after it\n"
    "Traceback (most recent call last):\n"
    '  File "/work/main/axonn_launch/train/loop.py", line 161, in train_loop\n'
    "axonn_launch.train.loop.NonFiniteError: non-finite gradients at step 7 (loss finite); the"
    " step was not applied and nothing was saved at or after it\n"
)
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
ENOSPC = "[rank0]: OSError: [Errno 28] No space left on device"
EROFS = "OSError: [Errno 30] Read-only file system: '/scratch/job/metrics.jsonl'"

CASES = [
    # (case, state, exit code, log text, expected class)
    ("completed", "COMPLETED", "0:0", "", failures.COMPLETED),
    ("pending", "PENDING", "0:0", "", failures.RUNNING),
    ("running", "RUNNING", "0:0", "", failures.RUNNING),
    ("requeued", "REQUEUED", "0:0", "", failures.RUNNING),
    ("sacct timeout", "TIMEOUT", "0:0", TIME_LIMIT, failures.TIMEOUT),
    ("time limit in the log", "FAILED", "1:0", TIME_LIMIT, failures.TIMEOUT),
    ("out of requeues", "FAILED", "1:0", SUBMITIT_TIMEOUT, failures.TIMEOUT),
    ("sacct preempted", "PREEMPTED", "0:0", "", failures.PREEMPTED),
    ("preemption in the log", "", "", PREEMPTION, failures.PREEMPTED),
    ("sacct node fail", "NODE_FAIL", "0:0", "", failures.NODE_FAILURE),
    ("node failure in the log", "FAILED", "1:0", NODE_FAIL_LOG, failures.NODE_FAILURE),
    ("sacct out of memory", "OUT_OF_MEMORY", "0:125", "", failures.HOST_OOM),
    ("oom kill in the log", "FAILED", "0:9", HOST_OOM, failures.HOST_OOM),
    ("python MemoryError", "FAILED", "1:0", "MemoryError: Unable to allocate", failures.HOST_OOM),
    ("CUDA OOM", "FAILED", "1:0", CUDA_OOM + "\n" + GLOO_PEER_CLOSED, failures.GPU_OOM),
    ("HIP OOM", "FAILED", "1:0", HIP_OOM, failures.GPU_OOM),
    (
        "NCCL error",
        "FAILED",
        "1:0",
        NCCL_ERROR + "\n" + GLOO_PEER_CLOSED,
        failures.COLLECTIVE_FAILURE,
    ),
    ("watchdog", "FAILED", "6:0", WATCHDOG, failures.COLLECTIVE_FAILURE),
    ("RCCL error", "FAILED", "1:0", RCCL_ERROR, failures.COLLECTIVE_FAILURE),
    ("only a lost peer", "FAILED", "1:0", GLOO_PEER_CLOSED, failures.COLLECTIVE_FAILURE),
    ("scancel", "CANCELLED by 0", "0:0", GLOO_PEER_CLOSED, failures.CANCELLED),
    ("scancel banner only", "", "", SCANCEL, failures.CANCELLED),
    ("kill -9 of a rank", "FAILED", "9:0", KILLED + GLOO_PEER_CLOSED, failures.RANK_KILLED),
    ("killed, no logs", "FAILED", "0:9", "", failures.RANK_KILLED),
    # Slurm could not open --output (a '%x' in the job dir, unescaped): not a signal, no retry
    ("log file not opened", "FAILED", "0:53", "", failures.CODE_ERROR),
    ("srun killed", "FAILED", "9:0", SRUN_KILLED, failures.RANK_KILLED),
    ("step banner alone", "FAILED", "9:0", SRUN_KILLED.splitlines()[1], failures.RANK_KILLED),
    ("slurmstepd killed", "FAILED", "0:0", STEPD_KILLED, failures.RANK_KILLED),
    ("code error", "FAILED", "1:0", VALUE_ERROR + SRUN_TERMINATED, failures.CODE_ERROR),
    (
        "code error, peers lost",
        "FAILED",
        "1:0",
        VALUE_ERROR + GLOO_PEER_CLOSED,
        failures.CODE_ERROR,
    ),
    ("disk full", "FAILED", "1:0", ENOSPC + "\n" + GLOO_PEER_CLOSED, failures.STORAGE_FULL),
    ("read-only job dir", "FAILED", "1:0", EROFS, failures.STORAGE_ERROR),
    (
        "watchdog hang, peers lost",
        "FAILED",
        "75:0",
        HANG_LINE + "\n" + GLOO_PEER_CLOSED,
        failures.HANG,
    ),
    ("hang, peers' NCCL timeout", "FAILED", "75:0", WATCHDOG + "\n" + HANG_LINE, failures.HANG),
    ("non-finite step", "FAILED", "1:0", NON_FINITE + SRUN_TERMINATED, failures.NON_FINITE),
    ("GPU off the bus", "FAILED", "1:0", XID_79 + "\n" + NCCL_ERROR, failures.NODE_FAILURE),
    ("nothing known", "FAILED", "1:0", "", failures.UNKNOWN),
    ("no state at all", "", "", "", failures.UNKNOWN),
]


@pytest.mark.parametrize(
    "state, exit_code, text, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_classification_table(state, exit_code, text, expected):
    ev = Evidence(state=state, exit_code=exit_code, logs={0: text} if text else {})
    assert classify(ev).failure == expected


def test_completed_in_sacct_with_a_task_missing_its_result_is_a_kill():
    """A killed slurmstepd leaves srun exiting 0: sacct says COMPLETED, a task never returned."""
    whole = Evidence(state="COMPLETED", results=(("success", ""),) * 2, expected_results=2)
    assert classify(whole).failure == failures.COMPLETED
    lost = Evidence(state="COMPLETED", results=(), expected_results=2, logs={0: STEPD_KILLED})
    assert classify(lost) == Diagnosis(failures.RANK_KILLED, STEPD_KILLED.splitlines()[1])
    silent = Evidence(state="COMPLETED", results=(("success", ""),), expected_results=2)
    assert classify(silent).failure == failures.RANK_KILLED
    assert "1 of 2 tasks returned" in classify(silent).reason


def test_every_class_the_classifier_returns_has_a_documented_action():
    """Drive classify() over the evidence of every case: the classes it returns are exactly
    the classes with an action (none without one, none unreachable), each documented."""
    actions = {
        failures.NONE, failures.WAIT, failures.RESUME, failures.RESUME_EXCLUDING,
        failures.RETRY_WITH_NEW_GRID, failures.DO_NOT_RETRY, failures.REPORT, failures.STOP,
    }  # fmt: skip
    returned = set()
    for _, state, exit_code, text, _ in CASES:
        logs = {0: text} if text else {}
        diagnosis = classify(Evidence(state=state, exit_code=exit_code, logs=logs))
        assert diagnosis.action in actions, diagnosis  # raises KeyError without an action
        returned.add(diagnosis.failure)
    assert returned == set(failures.ACTIONS)
    for failure in returned:
        assert f"\n{failure} " in failures.__doc__, failure
    assert failures.ACTIONS[failures.CODE_ERROR] == failures.DO_NOT_RETRY
    assert failures.ACTIONS[failures.GPU_OOM] == failures.RETRY_WITH_NEW_GRID
    assert failures.ACTIONS[failures.UNKNOWN] == failures.REPORT
    for failure in (failures.NODE_FAILURE, failures.COLLECTIVE_FAILURE):
        assert failures.ACTIONS[failure] == failures.RESUME_EXCLUDING


def test_result_pickles_decide_success_and_errors():
    ok = (("success", ""),) * 4
    assert classify(Evidence(state="", results=ok, expected_results=4)).failure == "completed"
    partial = Evidence(state="", results=ok[:3], expected_results=4)
    assert classify(partial).failure == failures.UNKNOWN
    errored = Evidence(state="", results=(("error", CUDA_OOM),), expected_results=1)
    assert classify(errored).failure == failures.GPU_OOM


def test_nodes_to_exclude():
    node_fail = classify(Evidence(state="FAILED", logs={0: NODE_FAIL_LOG}, nodes=("n1", "n2")))
    assert node_fail.bad_nodes == ("n2",)
    sacct_only = classify(Evidence(state="NODE_FAIL", nodes=("n1", "n2")))
    assert sacct_only.bad_nodes == ("n1", "n2")  # no log names the node: all of the job's
    logs = {0: GLOO_PEER_CLOSED, 1: GLOO_PEER_CLOSED, 2: NCCL_ERROR, 3: GLOO_PEER_CLOSED}
    ev = Evidence(state="FAILED", logs=logs, nodes=("n1", "n2", "n3"), tasks_per_node=2)
    collective = classify(ev)
    assert collective.failure == failures.COLLECTIVE_FAILURE
    assert collective.bad_nodes == ("n2",)  # task 2 saw the error itself; tasks 2,3 on n2


GPU_FAULTS = Path(__file__).parents[1] / "fixtures" / "gpu_faults"


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("nvidia_xid79_off_the_bus.log", failures.NODE_FAILURE),
        ("nvidia_xid48_double_bit_ecc.log", failures.NODE_FAILURE),
        ("nvidia_xid63_row_remap.log", failures.NODE_FAILURE),
        ("nvidia_xid64_row_remap_failure.log", failures.NODE_FAILURE),
        ("nvidia_xid74_nvlink.log", failures.NODE_FAILURE),  # before the NCCL error it causes
        ("nvidia_xid94_contained_ecc.log", failures.NODE_FAILURE),
        ("nvidia_xid95_uncontained_ecc.log", failures.NODE_FAILURE),
        ("cuda_ecc_uncorrectable.log", failures.NODE_FAILURE),  # not a code error
        ("nccl_ecc_uncorrectable.log", failures.NODE_FAILURE),  # not a collective failure
        ("hip_ecc_not_correctable.log", failures.NODE_FAILURE),
        ("amdgpu_ras_umc_uncorrectable.log", failures.NODE_FAILURE),
        ("amdgpu_ras_athub.log", failures.NODE_FAILURE),
        # "no uncorrectable ...": all clear; only the peers lost their connections
        ("amdgpu_ras_all_clear.log", failures.COLLECTIVE_FAILURE),
        ("nvidia_xid13_application.log", failures.CODE_ERROR),  # the program's own fault
    ],
)
def test_gpu_hardware_faults_exclude_the_node_of_the_task_that_saw_them(fixture, expected):
    """Task 2 of four (two per node) logged the fault: its node, n2, is left out; its peers
    only lost their connections."""
    text = (GPU_FAULTS / fixture).read_text()
    logs = {0: GLOO_PEER_CLOSED, 1: GLOO_PEER_CLOSED, 2: text, 3: GLOO_PEER_CLOSED}
    ev = Evidence(state="FAILED", exit_code="1:0", logs=logs, nodes=("n1", "n2"),
                  tasks_per_node=2)  # fmt: skip
    diagnosis = classify(ev)
    assert diagnosis.failure == expected, diagnosis
    if expected == failures.NODE_FAILURE:
        assert diagnosis.bad_nodes == ("n2",), diagnosis
        assert diagnosis.reason in text


def test_a_gpu_fault_in_a_failure_record_names_the_record_host():
    """Without a log line (the node's logs were lost), a rank's failure record holds it:
    the record's host is left out."""
    record = {
        "rank": 3,
        "host": "n7",
        "time": 10.0,
        "exception": "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    }
    ev = Evidence(state="FAILED", exit_code="1:0", logs={0: GLOO_PEER_CLOSED},
                  records=(record["exception"],), failure_records=(record,))  # fmt: skip
    diagnosis = classify(ev)
    assert (diagnosis.failure, diagnosis.bad_nodes) == (failures.NODE_FAILURE, ("n7",))


def test_nodelist_expansion():
    assert failures.expand_nodelist("n[1-3,7]") == ("n1", "n2", "n3", "n7")
    assert failures.expand_nodelist("nid[000098-000100],login1") == (
        "nid000098",
        "nid000099",
        "nid000100",
        "login1",
    )
    assert failures.expand_nodelist("None assigned") == ()


# --- status on synthetic job directories -------------------------------------------------


def make_job(
    root: Path,
    name: str,
    job_id: str,
    *,
    results: list[tuple[str, object]] = (),
    logs: dict[int, str] | None = None,
    steps_done: int = 0,
    total: int = 20,
    **record,
) -> Path:
    job_dir = root / name
    folder = job_dir / "slurm" / job_id
    folder.mkdir(parents=True)
    base = {
        "name": name,
        "job_dir": str(job_dir),
        "job_ids": [job_id],
        "machine": "slurm_local",
        "scheduler": "slurm",
        "model": "gpt_tiny",
        "grid": {"data": 1, "x": 2, "y": 1, "z": 1},
        "nodes": 1,
        "tasks_per_node": 2,
        "steps": total,
        "attempt": 1,
        "lineage": [],
        "command_line": ["axonn_launch", "machine=slurm_local", "grid.x=2", "train.steps=20"],
        "status": "submitted",
    }
    (job_dir / "job.json").write_text(json.dumps({**base, **record}))
    for task, result in enumerate(results):
        with open(folder / f"{job_id}_{task}_result.pkl", "wb") as handle:
            pickle.dump(result, handle)
    for task, text in (logs or {}).items():
        (folder / f"{job_id}_{task}_log.err").write_text(text)
        (folder / f"{job_id}_{task}_log.out").write_text("")
    rows = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(1, steps_done + 1)]
    (job_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return job_dir


def fake_tools(tmp_path: Path, *, sacct: str | None, squeue: str = "") -> dict[str, str]:
    """PATH with a sacct that prints ``sacct`` (or fails when None) and a squeue."""
    no_accounting = fake_slurm.failing("sacct: error: Slurm accounting storage is disabled")
    sacct_body = no_accounting if sacct is None else fake_slurm.printing(sacct)
    tools = {"sacct": sacct_body, "squeue": fake_slurm.printing(squeue)}
    bindir = fake_slurm.fake_tools(tmp_path / "bin", tools, calls=tmp_path / "calls")
    return {"PATH": fake_slurm.on_path(bindir)}


def called(tmp_path: Path) -> list[str]:
    """The tools ``fake_tools`` saw called, in order."""
    return [line.split()[0] for line in (tmp_path / "calls").read_text().splitlines()]


@pytest.fixture
def job_root(tmp_path):
    root = tmp_path / "jobs"
    make_job(root / "sweep", "done", "101", results=[("success", {})] * 2, steps_done=20)
    make_job(root / "sweep", "oom", "102", results=[("error", CUDA_OOM)], steps_done=3,
             logs={0: CUDA_OOM, 1: GLOO_PEER_CLOSED})  # fmt: skip
    make_job(root, "queued", "103")
    make_job(root, "killed", "104", logs={0: KILLED}, steps_done=7)
    make_job(root, "timeout", "105", steps_done=12, logs={0: TIME_LIMIT})
    return root


SACCT = "\n".join(
    [
        "101|COMPLETED|0:0|n1",
        "102|FAILED|1:0|n1",
        "103|PENDING|0:0|None assigned",
        "104|FAILED|9:0|n2",
        "105|TIMEOUT|0:0|n1",
    ]
)


def by_name(rows: list[status.JobStatus]) -> dict[str, status.JobStatus]:
    return {row.name: row for row in rows}


def test_status_with_sacct_one_call_for_all_jobs(job_root, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_tools(tmp_path, sacct=SACCT)["PATH"])
    rows = by_name(status.collect([str(job_root)]))
    # one sacct call for all jobs, and one squeue --start for the pending ones' estimate
    assert called(tmp_path) == ["sacct", "squeue"]
    expected = {
        "done": ("COMPLETED", failures.COMPLETED, 20),
        "oom": ("FAILED", failures.GPU_OOM, 3),
        "queued": ("PENDING", failures.RUNNING, None),
        "killed": ("FAILED", failures.RANK_KILLED, 7),
        "timeout": ("TIMEOUT", failures.TIMEOUT, 12),
    }
    assert {n: (r.state, r.failure, r.step) for n, r in rows.items()} == expected
    assert rows["killed"].loss == pytest.approx(5.0 - 0.7)
    assert rows["oom"].grid == "data=1 x=2 y=1 z=1" and rows["oom"].steps == 20


def test_status_without_accounting_uses_squeue_results_and_logs(job_root, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_tools(tmp_path, sacct=None, squeue="103|PENDING|")["PATH"])
    rows = by_name(status.collect([str(job_root)]))
    assert called(tmp_path) == ["sacct", "squeue", "squeue"]  # --start
    assert (
        rows["queued"].expected_start == "pending: Slurm has no start estimate yet (squeue --start)"
    )
    assert {n: r.failure for n, r in rows.items()} == {
        "done": failures.COMPLETED,  # all result pickles say success
        "oom": failures.GPU_OOM,  # the error pickle's traceback
        "queued": failures.RUNNING,  # squeue lists it
        "killed": failures.RANK_KILLED,  # srun's line in the log
        "timeout": failures.TIMEOUT,  # slurmstepd's line in the log
    }


def test_status_command_prints_rows_and_json(job_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", fake_tools(tmp_path, sacct=SACCT)["PATH"])
    assert jobs.main(["status", str(job_root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if not line.startswith("  ")]
    reasons = [line.strip() for line in lines if line.startswith("  ")]
    assert table[0].split()[:4] == ["JOB", "ID", "GRID", "STATE"]
    assert len(table) == 6 and any("gpu_oom" in line and "3/20" in line for line in table)
    # under the table, each ended job that was not completed says why, and what to do
    assert len(reasons) == 3 and any("CUDA out of memory" in r for r in reasons), reasons
    assert any(r.endswith("(action: retry_only_with_new_grid)") for r in reasons), reasons
    assert jobs.main(["status", str(job_root / "sweep"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["job_id"] for r in rows) == ["101", "102"]


def test_resubmit_dry_run_decisions(job_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", fake_tools(tmp_path, sacct=SACCT)["PATH"])
    assert jobs.main(["resubmit", str(job_root), "--dry-run"]) == 0
    lines = {line.split()[1] if line.startswith("skip") else line.split()[2]: line
             for line in capsys.readouterr().out.splitlines()}  # fmt: skip
    assert lines["101"].startswith("skip") and "completed" in lines["101"]
    assert lines["102"].startswith("skip") and "new grid" in lines["102"]
    assert lines["103"].startswith("skip") and "running" in lines["103"]
    assert lines["104"].startswith("would resubmit") and "killed_attempt2" in lines["104"]
    assert lines["105"].startswith("would resubmit") and "wait=false" in lines["105"]
    assert not (job_root / "killed_attempt2").exists()  # a dry run writes nothing
    # with a new grid, the out-of-memory job may retry; --only narrows to one class
    assert jobs.main(["resubmit", str(job_root), "--dry-run", "--only", "gpu_oom", "grid.x=1"]) == 0
    out = capsys.readouterr().out
    assert "would resubmit 102" in out and "grid.x=1" in out and "grid.x=2" not in out
    assert "would resubmit 104" not in out


def test_resubmit_twice_submits_once(job_root, tmp_path, monkeypatch, capsys, fake_sbatch):
    bindir, marker = fake_sbatch
    tools = fake_tools(tmp_path, sacct=SACCT)["PATH"]
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{tools}")
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        jobs.main(["resubmit", str(job_root), "--only", "rank_killed"])
    out = capsys.readouterr().out
    calls = marker.read_text().splitlines()
    attempts = [c for c in calls if "recovery.sh" not in c]
    assert len(attempts) == 1, calls
    assert len(calls) == 2 and "--dependency=afterany:" in calls[1]  # its recovery job
    assert "already resubmitted" in out
    new = json.loads((job_root / "killed_attempt2" / "job.json").read_text())
    old = json.loads((job_root / "killed" / "job.json").read_text())
    assert old["resubmitted_as"] == str(job_root / "killed_attempt2")
    assert new["attempt"] == 2 and new["parent"] == str(job_root / "killed")
    assert new["lineage"][0]["failure"] == failures.RANK_KILLED
    assert new["job_ids"] == ["1"]


def test_a_resubmission_that_died_half_way_does_not_block_the_next(
    job_root, tmp_path, monkeypatch, capsys, fake_sbatch
):
    """A recovery job killed after writing the mark, before the attempt's job.json (its node
    went down): the mark names no attempt, so the job is resubmitted, once."""
    bindir, marker = fake_sbatch
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{fake_tools(tmp_path, sacct=SACCT)['PATH']}")
    monkeypatch.chdir(tmp_path)
    killed = job_root / "killed"
    record = json.loads((killed / "job.json").read_text())
    (killed / "job.json").write_text(
        json.dumps({**record, "resubmitted_as": str(killed) + "_attempt2"})
    )
    assert jobs.main(["resubmit", str(killed)]) == 0
    assert "already resubmitted" not in capsys.readouterr().out
    assert json.loads((job_root / "killed_attempt2" / "job.json").read_text())["attempt"] == 2
    assert jobs.main(["resubmit", str(killed)]) == 0
    assert "already resubmitted" in capsys.readouterr().out
    assert len([c for c in marker.read_text().splitlines() if "recovery.sh" not in c]) == 1


def test_new_overrides_merge_and_exclude():
    old = ["machine=slurm_local", "grid.x=2", "+machine.slurm.extra_sbatch.exclude=n3", "wait=true"]
    merged = resubmit.new_overrides(old, ["grid.x=1", "grid.data=2"], ("n1",))
    assert merged == [
        "machine=slurm_local",
        "grid.x=1",
        "grid.data=2",
        "+machine.slurm.extra_sbatch.exclude=n1,n3",
        "wait=false",
    ]


def test_a_shrink_replaces_the_whole_grid():
    """The recovery's ``grid=auto`` (a replanned grid) drops every ``grid.*`` of the launch."""
    old = ["machine=slurm_local", "grid.x=2", "grid.z=2", "nodes=2", "train.steps=12"]
    merged = resubmit.new_overrides(old, ["nodes=1", "grid=auto"], ("n2",))
    assert merged == [
        "machine=slurm_local",
        "train.steps=12",
        "nodes=1",
        "grid=auto",
        "+machine.slurm.extra_sbatch.exclude=n2",
        "wait=false",
    ]


# --- fault injection ---------------------------------------------------------------------


def test_fault_specs_parse_and_reject():
    assert faults.parse("") == []
    assert faults.parse("collective@step5:rank1, pause@step9:30") == [
        faults.Fault("collective", 5, 1, None),
        faults.Fault("pause", 9, None, 30),
    ]
    with pytest.raises(ValueError, match="KIND@stepN"):
        faults.parse("segfault@step3")


def test_fault_hook_fires_once_on_its_step_and_rank():
    calls = []
    hook = faults.step_hook(lambda: calls.append(1) or False, rank=1, start_step=2,
                            environ={"AXONN_FAULT": "gpu_oom@step4:rank1"})  # fmt: skip
    assert hook() is False  # after step 3
    with pytest.raises(Exception, match="CUDA out of memory") as raised:
        hook()  # after step 4
    assert (
        failures.classify_text(f"{type(raised.value).__name__}: {raised.value}").failure
        == "gpu_oom"
    )
    assert hook() is False and len(calls) == 2
    quiet = faults.step_hook(lambda: False, rank=0, start_step=0, environ={})
    assert all(quiet() is False for _ in range(10))


# --- checkpoints survive a rank killed while writing them ---------------------------------

CRASH_COLUMNS = 50_000  # elements of each rank's row of the sharded tensor


def _crash_specs(world: int, rank: int):
    """Rank r holds row r of a (world x CRASH_COLUMNS) tensor "w", as one flat shard."""
    from axonn_launch.train.parallel.shards import Piece, ShardSpec

    spec = ShardSpec((world, CRASH_COLUMNS), (Piece(0, (rank, 0), (1, CRASH_COLUMNS)),), True)
    return {"w": spec}


def _crash_state(step: int, rank: int) -> dict:
    import torch

    return {"w": torch.full((CRASH_COLUMNS,), float(step * 10 + rank)), "step": torch.tensor(step)}


def _saver(rank: int, world: int, store_path: str, job_dir: str, fault: str) -> None:
    """Save asynchronously in a loop until the fault point kills this process (or the
    test kills it); each rank's row encodes the step."""
    import torch.distributed as dist

    from axonn_launch.train.checkpoint.manager import FAULT_ENV, Checkpointer

    os.environ[FAULT_ENV] = fault
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    checkpointer = Checkpointer(job_dir, rank=rank, keep=2)
    specs = _crash_specs(world, rank)
    for step in range(1, 10_000):
        meta = {"grid": {"data": world, "x": 1, "y": 1, "z": 1}}
        checkpointer.save(step, _crash_state(step, rank), specs, meta)


def _evidence_of_a_save_in_flight(job_dir: Path, point: str, step: int) -> bool:
    """What each fault point leaves on disk when it really interrupted save ``step``."""
    root = job_dir / "checkpoints"
    tmp, final = root / f".tmp_step_{step:08d}", root / f"step_{step:08d}"
    latest = (root / "latest").read_text().strip()
    if point == "write":
        return tmp.is_dir() and not (tmp / ".metadata").exists() and not final.exists()
    if point == "metadata":
        return (tmp / ".metadata").exists() and not (tmp / "meta.json").exists()
    return (final / "meta.json").exists() and latest == f"step_{step - 1:08d}"


def _load_latest(job_dir: Path) -> int:
    """Read every tensor of the latest checkpoint in one process; returns its step."""
    import torch

    from axonn_launch.train.checkpoint.manager import latest_checkpoint, load_state, read_meta
    from axonn_launch.train.parallel.shards import Piece, ShardSpec

    latest = latest_checkpoint(job_dir)
    step = read_meta(latest)["step"]
    full = ShardSpec((2, CRASH_COLUMNS), (Piece(0, (0, 0), (2, CRASH_COLUMNS)),), True)
    state = {"w": torch.empty(2 * CRASH_COLUMNS), "step": torch.tensor(0)}
    load_state(latest, state, {"w": full})
    rows = state["w"].view(2, CRASH_COLUMNS)
    for rank in range(2):
        assert torch.equal(rows[rank], torch.full((CRASH_COLUMNS,), float(step * 10 + rank)))
    assert int(state["step"]) == step
    return step


@pytest.mark.slow
def test_rank_killed_while_saving_leaves_a_loadable_latest_checkpoint(tmp_path):
    """Each trial kills one rank with SIGKILL at a fault point inside its N-th
    asynchronous save (data written, .metadata written, renamed before ``latest``
    moved), checks on disk that the save was really in flight, and loads ``latest``."""
    import random

    from tests.train.dist_utils import forkserver_context

    rng = random.Random(2026)
    # forkserver: children fork from a clean process (forking a process whose OpenMP pool
    # is running, like this one after other torch tests, can hang the child); the shared
    # one has torch and the job side imported already
    context = forkserver_context()
    points = ["write", "write", "metadata", "rename"] * 3
    checked, unloadable = 0, []
    for trial, point in enumerate(points):
        job_dir = tmp_path / f"job{trial}"
        save, victim_rank = rng.randint(2, 4), rng.randrange(2) if point == "write" else 0
        fault = f"{point}@save{save}:rank{victim_rank}"
        store = str(tmp_path / f"store{trial}")
        procs = [
            context.Process(target=_saver, args=(r, 2, store, str(job_dir), fault))
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        victim = procs[victim_rank]
        victim.join(timeout=120)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        assert victim.exitcode == -signal.SIGKILL, f"{fault}: the fault point never fired"
        assert _evidence_of_a_save_in_flight(job_dir, point, save), f"{fault}: not mid-save"
        try:
            assert _load_latest(job_dir) == save - 1, "latest is not the previous save"
        except Exception as error:
            unloadable.append(f"{fault}: {error!r}")
        checked += 1
    assert unloadable == []
    assert checked == len(points) >= 10


@pytest.mark.parametrize(
    ("when", "why", "line"),
    [
        ("2026-12-06T05:10:00", "Priority",
         "pending: Slurm expects it to start at 2026-12-06 05:10:00 (squeue --start);"
         " it waits for: Priority"),
        ("N/A", "Resources",
         "pending: Slurm has no start estimate yet (squeue --start); it waits for: Resources"),
        ("PENDING", "None", "pending: Slurm has no start estimate yet (squeue --start)"),
    ],
)  # fmt: skip
def test_a_pending_job_s_start_is_slurm_s_estimate_or_said_to_be_unknown(when, why, line):
    assert slurm_queries.start_words(when, why) == line
