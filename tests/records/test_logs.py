"""``jobs logs`` on job dirs laid out as a local run and a Slurm run leave them (logs,
failure records, submitit's task files), in this process: which files each option picks
and the one-line errors. Real killed-rank runs are read by ``jobs logs --failed`` in
tests/submit/test_local_recovery.py (local) and tests/slurm/test_recovery.py (Slurm).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axonn_launch import jobs
from axonn_launch.records.logs import failed_rank, rank_logs, ranks_on_node


def line(rank: int, host: str, text: str) -> str:
    return f"2026-12-05 10:00:00,000 rank {rank} host {host} INFO axonn_launch.train.loop: {text}\n"


def job_dir(folder: Path, job_id: str, hosts: list[str], **record) -> Path:
    folder.mkdir(parents=True)
    (folder / "job.json").write_text(json.dumps({"job_ids": [job_id], **record}))
    (folder / "logs").mkdir()
    for rank, host in enumerate(hosts):
        (folder / "logs" / f"rank_{rank}.log").write_text(line(rank, host, f"step of rank {rank}"))
    return folder


def failure(folder: Path, rank: int, time: float, exception: str) -> None:
    (folder / "logs" / "failures").mkdir(exist_ok=True)
    record = {"rank": rank, "time": time, "host": "n1", "exception": exception, "tail": []}
    (folder / "logs" / "failures" / f"rank_{rank}.json").write_text(json.dumps(record))


def slurm_job(tmp_path: Path) -> Path:
    """Rank 3 (task 3, on n2) killed by SIGKILL: srun says so in task 0's stderr; ranks 0
    and 1 recorded only a lost peer (a symptom), before the kill was reported."""
    folder = job_dir(tmp_path / "slurm_run", "1234", ["n1", "n1", "n2", "n2"])
    tasks = folder / "slurm" / "1234"
    tasks.mkdir(parents=True)
    for task in range(4):
        (tasks / f"1234_{task}_log.out").write_text(f"stdout of task {task}\n")
        (tasks / f"1234_{task}_log.err").write_text(f"stderr of task {task}\n")
    (tasks / "1234_0_log.err").write_text("srun: error: n2: task 3: Killed\n")
    failure(folder, 0, 10.0, "RuntimeError: Connection closed by peer")
    failure(
        folder, 1, 11.0, "RuntimeError: gloo/transport/tcp/pair.cc:534 Connection reset by peer"
    )
    return folder


def test_the_failed_rank_is_the_one_jobs_status_names(tmp_path):
    cause = {"rank": 1, "signal": "SIGKILL", "line": "rank 1 killed"}
    killed = job_dir(tmp_path / "killed", "local-1", ["vm", "vm"], ended_by=cause)
    failure(killed, 0, 1.0, "RuntimeError: Connection closed by peer")
    raised = job_dir(tmp_path / "raised", "local-2", ["vm", "vm"])
    failure(raised, 0, 1.0, "RuntimeError: Connection closed by peer")  # a symptom, first
    failure(raised, 1, 2.0, "ValueError: bad batch")  # the cause
    ended = job_dir(tmp_path / "ended", "local-3", ["vm"])
    slurm = slurm_job(tmp_path)
    assert [failed_rank(d, json.loads((d / "job.json").read_text()))
            for d in (killed, raised, ended, slurm)] == [1, 1, None, 3]  # fmt: skip


def test_the_failed_rank_of_a_lost_node_is_its_first_rank_not_a_killed_peer(tmp_path):
    """A node set DOWN (n2) leaves no record of its ranks (2 and 3); srun reports the
    others killed (task 1 first here); the restart in place recorded the attempt's lost
    node in the run's chain (batch/restart.py). The real run: bench/scale/heal.py."""
    folder = slurm_job(tmp_path)
    (folder / "slurm" / "1234" / "1234_0_log.err").write_text("srun: error: n1: task 1: Killed\n")
    record = json.loads((folder / "job.json").read_text())
    assert failed_rank(folder, record) == 1  # no lost node recorded: srun's killed task
    lost = {"job_dir": str(folder), "class": "node_failure", "bad_nodes": ["n2"], "in_place": True}
    other = {**lost, "job_dir": str(tmp_path / "another"), "bad_nodes": ["n1"]}
    record["chain"] = {"attempts": [other, lost]}
    (folder / "job.json").write_text(json.dumps(record))
    assert failed_rank(folder, record) == 2


def test_a_rank_logs_the_node_as_slurm_names_it(tmp_path, monkeypatch):
    """The rank log's host is the Slurm node (``SLURMD_NODENAME``), which lost-node records
    name: on multiple-slurmd clusters, and wherever the host name differs."""
    from axonn_launch.records.logs import host_of
    from axonn_launch.train.logs import setup_logging

    monkeypatch.setenv("SLURMD_NODENAME", "frontier00042")
    logger = setup_logging(3, tmp_path)
    logger.info("a line")
    for handler in [h for h in logger.handlers if getattr(h, "axonn_rank_handler", False)]:
        handler.close()
        logger.removeHandler(handler)
    assert host_of(tmp_path / "logs" / "rank_3.log") == "frontier00042"


def test_a_slurm_rank_shows_its_task_output_and_its_own_log(tmp_path):
    folder = slurm_job(tmp_path)
    record = json.loads((folder / "job.json").read_text())
    assert [p.name for p in rank_logs(folder, record, 2)] == [
        "1234_2_log.out", "1234_2_log.err", "rank_2.log"
    ]  # fmt: skip
    assert ranks_on_node(folder, "n2") == [2, 3]


def test_jobs_logs_failed_prints_the_killed_slurm_rank(tmp_path, capsys):
    folder = slurm_job(tmp_path)
    assert jobs.main(["logs", str(folder), "--failed"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 3 failed first\n"), out
    assert "stdout of task 3" in out and "step of rank 3" in out and "task 2" not in out
    assert out.count("==> ") == 3  # the task's stdout and stderr, the rank's own log


def test_jobs_logs_of_one_node_and_of_one_rank(tmp_path, capsys):
    folder = slurm_job(tmp_path)
    assert jobs.main(["logs", str(folder), "--node", "n1"]) == 0
    out = capsys.readouterr().out
    assert "step of rank 0" in out and "step of rank 1" in out and "rank 2" not in out
    assert jobs.main(["logs", str(folder), "--rank", "2"]) == 0
    assert "stderr of task 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,said",
    [
        (["--rank", "9"], "--rank 9: no log in"),
        (["--node", "n7"], "--node n7: no rank of"),
        (["--attempt", "2"], "--attempt 2: the run of"),
    ],
)
def test_jobs_logs_bad_choices_are_one_line_exit_2(tmp_path, capsys, args, said):
    folder = slurm_job(tmp_path)
    assert jobs.main(["logs", str(folder), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and said in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_jobs_logs_of_a_run_that_never_failed_says_so(tmp_path, capsys):
    folder = job_dir(tmp_path / "fine", "local-1", ["vm", "vm"])
    assert jobs.main(["logs", str(folder), "--failed"]) == 2
    assert capsys.readouterr().err == f"error: {folder}: no rank failed\n"


def test_jobs_logs_follow_of_an_ended_job_prints_and_returns(tmp_path, capsys):
    folder = job_dir(tmp_path / "done", "local-1", ["vm"], status="completed")
    assert jobs.main(["logs", str(folder), "--follow"]) == 0
    assert capsys.readouterr().out == line(0, "vm", "step of rank 0")
