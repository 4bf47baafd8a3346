"""The warm start of local jobs (``train/zygote.py``, ``scheduler/processes.py``): ranks forked from
one process that imported the job side train exactly as ranks that each start Python
afresh (``AXONN_RANK_START=exec``), each is a process of its own with its own name and log,
and the process they fork from had one thread when it forked: one with more refuses to fork,
in one line naming them, and the ranks start afresh.

The run of each kind is made once (module fixtures) and read by every test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from axonn_launch.scheduler import processes
from tests.conftest import REPO, run_launcher

JOB = ["machine=local", "model=gpt_tiny", "train.steps=4", "train.sample_tokens=0",
       "train.progress=false"]  # fmt: skip


def launch(root: Path, mode: str) -> Path:
    job = root / mode
    env = {processes.RANK_START_VAR: mode}
    proc = run_launcher([*JOB, f"hydra.run.dir={job}"], cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return job


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("warm")
    return {mode: launch(root, mode) for mode in ("fork", "exec")}


def metrics(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_forked_ranks_train_exactly_as_fresh_ones(runs):
    forked, fresh = metrics(runs["fork"]), metrics(runs["exec"])
    assert [r["step"] for r in forked] == [r["step"] for r in fresh] == [1, 2, 3, 4]
    assert [r["loss"] for r in forked] == [r["loss"] for r in fresh]  # bit for bit
    for job in runs.values():
        record = json.loads((job / "job.json").read_text())
        assert record["status"] == "completed" and record["rank_exit_codes"] == [0] * 4
        assert len(set(record["rank_pids"])) == 4  # four processes, four pids
        for rank in range(1, 4):  # each rank's own log, as before
            assert f"rank {rank} host" in (job / "logs" / f"rank_{rank}.log").read_text()


def test_the_zygote_forks_from_one_thread_and_ends_when_nothing_is_asked(tmp_path):
    warm = processes.WarmStart(tmp_path, env={**os.environ})
    deadline = time.monotonic() + 120
    while not warm.threads and time.monotonic() < deadline and warm.process.poll() is None:
        time.sleep(0.05)
    assert warm.threads == 1  # imports only: no pool, no thread left running to fork over
    argv = Path(f"/proc/{warm.process.pid}/cmdline").read_bytes().split(b"\0")
    assert str(tmp_path).encode() in argv  # ps names the job dir it serves
    assert Path(f"/proc/{warm.process.pid}/comm").read_text().strip() == "axonn-zygote"
    warm.close()  # the job was abandoned before its ranks started
    assert warm.process.returncode == 0


def test_a_forked_rank_gets_its_exit_code_and_its_log(tmp_path):
    """A rank's exit code, through the real zygote: a job dir without spec.json makes every
    rank fail at once, as ``python -m axonn_launch.train`` would (code 1), its traceback in
    its own log. (tests/submit/test_local_supervisor.py finds running forked ranks by their name,
    ``axonn-rank-<N>``, and kills one.)"""
    warm = processes.WarmStart(tmp_path, env={**os.environ})
    ranks = processes.start_ranks(job_dir=tmp_path, world_size=2, warm=warm)
    assert all(isinstance(r, processes.ForkedRank) for r in ranks)  # forked: no refusal
    codes = [rank.wait(timeout=120) for rank in ranks]
    warm.close()
    assert codes == [1, 1] and [r.returncode for r in ranks] == [1, 1]
    assert "FileNotFoundError" in (tmp_path / "logs" / "rank_1.log").read_text()


def test_the_old_way_is_one_variable_away():
    assert processes.warm_start_wanted({})
    assert not processes.warm_start_wanted({processes.RANK_START_VAR: "exec"})
    code = "import axonn_launch.scheduler.processes, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # the supervisor's side stays free of torch


def test_ranks_start_afresh_when_the_zygote_cannot_import(tmp_path):
    """A zygote that dies in its imports (here a ``torch`` that refuses to import) leaves
    the ranks to start as fresh Pythons, which fail on their own, each in its own log, so
    the job still ends with every rank's code (and job.json final, as without the warm
    start)."""
    stub = tmp_path / "broken" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
    extra = {"PYTHONPATH": f"{stub.parent}{os.pathsep}{REPO}"}
    warm = processes.WarmStart(tmp_path, env={**os.environ, **extra})
    procs = processes.start_ranks(job_dir=tmp_path, world_size=2, env=extra, warm=warm)
    assert all(isinstance(p, subprocess.Popen) for p in procs)  # the fresh way
    assert [p.wait(timeout=120) for p in procs] == [1, 1]
    assert warm.process.poll() is not None
    # a fresh rank reads spec.json before it imports torch (an emulated rank never does):
    # this job dir has none, and the rank fails on that, in its own log
    assert "spec.json" in (tmp_path / "logs" / "rank_1.log").read_text()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no pool on one core")
def test_a_zygote_with_a_second_thread_refuses_to_fork_in_one_line(tmp_path, capsys):
    """A user's ``OPENBLAS_NUM_THREADS=2`` (the supervisor sets 1 only when it is unset):
    numpy's OpenBLAS starts a worker thread in the zygote as torch imports it, a native
    thread that no test hook makes. The zygote does not fork over it: one line names it
    (its tid and name), and the rank starts afresh, which also honours the user's setting
    (here it fails on its own, code 1: the job dir has no spec.json). One rank: each
    fresh one imports torch."""
    extra = {"OPENBLAS_NUM_THREADS": "2"}
    warm = processes.WarmStart(tmp_path, env={**os.environ, **extra})
    (proc,) = processes.start_ranks(job_dir=tmp_path, world_size=1, env=extra, warm=warm)
    assert isinstance(proc, subprocess.Popen)  # the fresh way
    assert proc.wait(timeout=120) == 1
    assert warm.process.poll() is not None and warm.pids == {}  # it forked nothing
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("supervisor: warm start refused: the zygote has 2 threads, not 1 ("), (
        line
    )
    assert re.search(r"\(\S+ \(tid \d+\)\)", line), line  # the pool's thread, by name and tid
    assert line.endswith("starting each rank afresh"), line


def test_the_refusal_names_a_python_thread_by_name_and_ident():
    """A thread started with ``threading`` (a library's helper, a sink's writer) is named
    as Python knows it: its name and ident, with its tid."""
    from axonn_launch.train import zygote

    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="a-sink-writer")
    worker.start()
    try:
        named = zygote.other_threads()
    finally:
        release.set()
        worker.join()
    assert f"a-sink-writer (ident {worker.ident}, tid {worker.native_id})" in named, named
    assert f"a-sink-writer (ident {worker.ident}" not in " ".join(zygote.other_threads())


# --- the early start: the supervisor and its zygote start before the launcher composes -----


def test_only_a_plain_local_run_starts_its_supervisor_early():
    wanted = processes.early_start_wanted
    env = {}
    assert wanted([], env) and wanted(["train.steps=5", "machine=local", "grid.x=2"], env)
    assert not wanted(["machine=frontier"], env)
    assert not wanted(["dry_run=true"], env) and not wanted(["rehearse=True"], env)
    assert not wanted(["wait=false"], env)  # a detached job's supervisor writes to a file
    assert not wanted(["-m", "grid.x=1,2"], env) and not wanted(["--help"], env)
    assert not wanted([], {processes.RANK_START_VAR: "exec"})


def child_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children]


def test_an_early_supervisor_takes_its_job_and_names_its_job_dir(tmp_path, monkeypatch):
    """Handed a job, it and its zygote show the job dir in their command lines, as when
    started with it (``ps``; ``processes.live_supervisors`` finds it by it)."""
    monkeypatch.setattr(processes, "EARLY_SUPERVISOR", [])
    processes.start_early_supervisor(["train.steps=1"])
    (early,) = processes.EARLY_SUPERVISOR
    supervisor = processes.start_supervisor(job_dir=tmp_path, world_size=2, env={})
    assert supervisor is early and processes.EARLY_SUPERVISOR == []
    deadline = time.monotonic() + 60
    argv: list[bytes] = []
    while str(tmp_path).encode() not in argv and time.monotonic() < deadline:
        argv = Path(f"/proc/{early.pid}/cmdline").read_bytes().split(b"\0")
        time.sleep(0.05)
    assert str(tmp_path).encode() in argv
    (zygote,) = child_pids(early.pid)
    early.stdin.close()  # the launcher ended before its GO: no rank starts
    assert early.wait(timeout=60) == 1
    assert not Path(f"/proc/{zygote}").exists()  # killed and reaped


def test_an_early_supervisor_without_a_job_ends_without_a_word(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "EARLY_SUPERVISOR", [])
    processes.start_early_supervisor([])
    (early,) = processes.EARLY_SUPERVISOR
    processes.dismiss_early_supervisor()  # a dry run, another machine, or bad input
    assert early.wait(timeout=60) == 0 and processes.EARLY_SUPERVISOR == []


def test_the_early_zygote_is_started_afresh_when_the_job_changes_its_environment(
    tmp_path, monkeypatch
):
    """It imported under the launcher's environment: one that the job changes (but for the
    thread counts each rank sets itself) needs a zygote that imports under the job's."""
    from axonn_launch.batch import supervise

    class Warm:
        def __init__(self, job_dir: Path) -> None:
            self.job_dir, self.closed = job_dir, False

        def close(self, *, kill: bool = False) -> None:
            self.closed = kill

    monkeypatch.setattr(processes, "WarmStart", Warm)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    early = Warm(Path(processes.BLANK))
    same = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert supervise.take_environment(same, early, tmp_path) is early and not early.closed
    assert os.environ == same
    fresh = supervise.take_environment({**same, "TORCH_LOGS": "+dynamo"}, early, tmp_path)
    assert early.closed and fresh is not early and fresh.job_dir == tmp_path
