"""AXONN_FAULT in machine=local jobs: the launcher's own rank processes, no Slurm."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_launcher


@pytest.mark.slow
def test_a_failing_rank_fails_the_local_job_and_stops_the_others(tmp_path):
    job = tmp_path / "job"
    proc = run_launcher(
        ["machine=local", "model=gpt_tiny", "train.steps=8", "train.progress=false",
         f"hydra.run.dir={job}"],
        cwd=REPO, env={"AXONN_FAULT": "code@step3:rank1"}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    # The fault fires at step 3's boundary (where the loop asks whether to stop), before
    # rank 0 writes step 3's row; the other ranks are stopped, not left waiting.
    assert [r["step"] for r in rows] == [1, 2]
    log = (job / "logs" / "rank_1.log").read_text()
    assert "AXONN_FAULT: injecting code after step 3 on rank 1" in log and "ValueError" in log
    assert not (job / "summary.json").exists()
    # the cause is what the console ends with, not rank 0's lost connection
    last = proc.stderr.strip().splitlines()
    headline = next(line for line in reversed(last) if "failed first" in line)
    assert headline.startswith("rank 1 (host ") and headline.endswith(
        "failed first: ValueError: injected code error on rank 1 (AXONN_FAULT)"
    ), last[-12:]
    assert last[-1].strip() == "ValueError: injected code error on rank 1 (AXONN_FAULT)"
    status = subprocess.run(
        [sys.executable, "-m", "axonn_launch.jobs", "status", str(job)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert " code_error " in status.stdout and headline in status.stdout, status.stdout
