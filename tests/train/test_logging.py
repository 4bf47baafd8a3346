"""Logging: the launcher's record in the job dir's axonn_launch.log, and the job's lines
(every rank's file, rank 0's console) naming rank and host."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_launcher

HOST = re.escape(socket.gethostname())
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


@pytest.mark.slow
def test_a_local_run_logs_the_launch_and_every_rank_with_rank_and_host(tmp_path):
    job = tmp_path / "job"
    args = ["machine=local", "grid.x=2", "grid.z=1", "train.steps=2", "train.warmup_steps=1",
            "train.sample_tokens=0", "train.progress=false", f"hydra.run.dir={job}"]  # fmt: skip
    result = run_launcher(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

    launch_log = (job / "axonn_launch.log").read_text()
    assert re.search(r"\]\[axonn_launch\.submit\.pipeline\]\[INFO\] - launching\n", launch_log), (
        launch_log
    )
    assert re.search(r"^grid +data=1 x=2 y=1 z=1 = 2 ranks$", launch_log, re.M), launch_log
    assert re.search(r"- local-\d+ completed \(exit code 0\)$", launch_log, re.M), launch_log
    # the console gets the summary once, printed, not a second time through Hydra's logging
    assert "[axonn_launch.submit.pipeline]" not in result.stdout
    assert result.stdout.count("grid       data=1 x=2 y=1 z=1 = 2 ranks") == 1

    for rank in (0, 1):
        lines = (job / "logs" / f"rank_{rank}.log").read_text().splitlines()
        training = rf"^{STAMP} rank {rank} host {HOST} INFO axonn_launch\.train\.loop: training"
        assert any(re.match(training, line) for line in lines), lines
    done = rf"^{STAMP} rank 0 host {HOST} INFO axonn_launch\.train\.metrics: done: 2 steps"
    assert re.search(done, (job / "logs" / "rank_0.log").read_text(), re.M)
    assert re.search(done, result.stdout, re.M), result.stdout[-2000:]  # rank 0's console
    assert "rank 1 host" not in result.stdout  # the other ranks write to their file only


SETUP_THEN_LOG = """
import logging, sys
from axonn_launch.train.logs import setup_logging
setup_logging(int(sys.argv[1]), sys.argv[2])
setup_logging(int(sys.argv[1]), sys.argv[2])  # again: still one line per record
logging.getLogger("axonn_launch.train.startup").info("hosts %s", "n1,n2")
logging.getLogger("axonn_launch.train.startup").debug("a detail")  # the rank file only
logging.getLogger("torch").info("not ours")
"""


@pytest.mark.parametrize("rank", [0, 3])
def test_every_job_module_logger_gets_rank_host_and_the_rank_file(tmp_path, rank):
    result = subprocess.run(
        [sys.executable, "-c", SETUP_THEN_LOG, str(rank), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    line = rf"{STAMP} rank {rank} host {HOST} INFO axonn_launch\.train\.startup: hosts n1,n2"
    detail = rf"{STAMP} rank {rank} host {HOST} DEBUG axonn_launch\.train\.startup: a detail"
    logged = (tmp_path / "logs" / f"rank_{rank}.log").read_text()
    assert re.fullmatch(line + "\n" + detail + "\n", logged), logged
    assert re.fullmatch(line + "\n", result.stdout) if rank == 0 else result.stdout == ""
    assert result.stderr == ""
