"""Records validated on read, and status from the newest evidence.

Every record ``jobs status`` reads goes through one schema (``common/jobdir.py``): a job dir
whose job.json is garbage, a JSON list or names a job id in no known form is one
``UNREADABLE job.json: <why>`` row, and every other job is still listed (before: the whole
listing crashed, or the dir vanished). A requeued allocation that runs while the summary
its predecessor wrote on stopping is still in the dir shows its own step and loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import (
    FAILURE_SCHEMA,
    JOB_RECORD_SCHEMA,
    JobPaths,
    RecordError,
    is_job_id,
    read_failures,
    read_record,
    schema_problem,
    write_record_file,
    write_summary,
)
from axonn_launch.records.jobdirs import run_results
from axonn_launch.submit.chain import ownership_problem
from tests.cli_server import run_module

BAD_RECORDS = {
    "garbage": ("{not json", "job.json: not JSON"),
    "a_list": ("[1, 2, 3]", "job.json: a JSON list, not an object"),
    "local_abc": (
        json.dumps({"job_ids": ["local-abc"], "name": "x", "status": "running"}),
        'job.json: job_ids[0]="local-abc": not a job id',
    ),
}


def dead_pid() -> int:
    """A pid no process has now (a local job's supervisor that ended)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(done.stdout)


def local_record(job_dir: Path, job_id: str, status: str, steps: int = 20) -> dict:
    """job.json as submit/pipeline.py writes it for a local job."""
    return {
        "name": job_dir.name, "job_dir": str(job_dir), "job_ids": [job_id], "machine": "local",
        "scheduler": "local", "model": "gpt_tiny", "grid": {"data": 1, "x": 1, "y": 1, "z": 1},
        "nodes": 1, "tasks_per_node": 1, "steps": steps, "attempt": 1, "lineage": [],
        "command_line": ["axonn_launch", "machine=local"], "status": status,
        "submit_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "submitted_at": time.time(),
    }  # fmt: skip


def write_metrics(job_dir: Path, losses: dict[int, float], tokens_per_s: float = 900.0) -> None:
    rows = [{"step": s, "loss": loss, "tokens_per_s": tokens_per_s, "step_time_s": 0.25}
            for s, loss in losses.items()]  # fmt: skip
    JobPaths(job_dir).metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))


def said(stderr: str) -> list[str]:
    """stderr's lines, without the RuntimeWarning runpy prints when the test CLI server runs
    a module it preloaded (tests/cli_server.py; a fresh interpreter prints none)."""
    return [ln for ln in stderr.splitlines() if "RuntimeWarning: 'axonn_launch" not in ln]


def status(*paths: Path) -> subprocess.CompletedProcess:
    return run_module("axonn_launch.jobs", ["status", *map(str, paths)], cwd=paths[0])


def test_bad_job_records_are_one_unreadable_row_each_and_the_rest_is_listed(tmp_path):
    root = tmp_path / "jobs"
    for name, (text, _) in BAD_RECORDS.items():
        (root / name).mkdir(parents=True)
        (root / name / "job.json").write_text(text)
    done = root / "done"
    done.mkdir()
    write_record_file(done, local_record(done, f"local-{dead_pid()}", "completed"))
    write_metrics(done, {20: 2.5})
    write_summary(done, {"steps": 20, "final_loss": 2.5, "tokens_per_s": 900.0})
    bad_failure = JobPaths(done).failures
    bad_failure.mkdir(parents=True)
    (bad_failure / "rank_1.json").write_text(json.dumps({"rank": 1, "time": "yesterday"}))
    dry = root / "dry"
    dry.mkdir()
    write_record_file(dry, {**local_record(dry, "", "dry_run"), "job_ids": [], "dry_run": True})

    shown = status(root)
    assert shown.returncode == 0, shown.stderr
    assert "Traceback" not in shown.stderr, shown.stderr
    for name, (_, why) in BAD_RECORDS.items():
        lines = [ln for ln in shown.stdout.splitlines() if ln.startswith(f"  {name}: ")]
        assert len(lines) == 1, shown.stdout
        assert lines[0].startswith(f"  {name}: UNREADABLE {why}"), lines
    table = shown.stdout.split("\n  ")[0].splitlines()
    assert len(table) == 1 + 5, shown.stdout  # the header, and one row per dir
    assert sum("UNREADABLE" in row for row in table) == 3, table
    done_row = next(row for row in table if row.endswith(" done"))
    assert "COMPLETED" in done_row and "20/20" in done_row and "2.5" in done_row, done_row
    assert any(row.endswith(" dry") and "DRY_RUN" in row for row in table), table
    # a failure record that fails its schema is named under its job, not dropped
    assert 'UNREADABLE logs/failures/rank_1.json: time="yesterday": a string' in shown.stdout

    rows = json.loads(status(root, "--json").stdout)
    by_dir = {Path(r["job_dir"]).name: r for r in rows}
    assert sorted(by_dir) == sorted([*BAD_RECORDS, "done", "dry"])
    assert {by_dir[n]["state"] for n in BAD_RECORDS} == {"UNREADABLE"}
    # jobs stop acts on nothing it cannot read: one line, exit code 2, job.json as it was
    stopped = run_module("axonn_launch.jobs", ["stop", str(root / "local_abc")], cwd=root)
    assert stopped.returncode == 2 and stopped.stdout == "", stopped
    assert said(stopped.stderr) == [
        f"error: {root / 'local_abc'}: UNREADABLE {BAD_RECORDS['local_abc'][1]}; expected a Slurm"
        " id (digits, optionally _<array> or +<het>) or local-<pid>; nothing cancelled"
    ]
    assert (root / "local_abc" / "job.json").read_text() == BAD_RECORDS["local_abc"][0]


def test_the_schema_reads_what_the_launcher_writes_and_names_what_is_wrong(tmp_path):
    for job_id in ("123", "123_4", "123+1", "local-4242"):
        assert is_job_id(job_id), job_id
    for job_id in ("local-abc", "12a", "", "123_", "-1", 123, "local-"):
        assert not is_job_id(job_id), job_id
    good = local_record(tmp_path, "local-1", "running")
    assert schema_problem(good, JOB_RECORD_SCHEMA) is None
    wrong = {
        "nodes": ("2", 'nodes="2": a string, expected integer'),
        "grid": ({"x": "2 3"}, 'grid.x="2 3": not an integer'),
        "job_ids": ("123", 'job_ids="123": a string, expected list'),
        "lineage": ([{"dir": "/x"}], "lineage[0]: not an object with a job_dir string"),
        "chain": ({"attempts": [{"action": "resume"}]},
                  "chain.attempts[0]: not an object with a class string"),
        "recovery_job": ("abc", 'recovery_job="abc": not a job id'),
        "attempt": (True, "attempt=true: a boolean, expected integer"),
    }  # fmt: skip
    for key, (value, why) in wrong.items():
        found = schema_problem({**good, key: value}, JOB_RECORD_SCHEMA)
        assert found is not None and found.startswith(why), (key, found)
    without_ids = {k: v for k, v in good.items() if k != "job_ids"}
    assert schema_problem(without_ids, JOB_RECORD_SCHEMA) == "job_ids: missing (a required field)"
    (tmp_path / "job.json").write_text(json.dumps({**good, "steps": 1.5}))
    with pytest.raises(RecordError, match=r"^job\.json: steps=1\.5: a number, expected integer$"):
        read_record(tmp_path)
    # failure records: a malformed one is left out, the others still sorted by time
    folder = JobPaths(tmp_path).failures
    folder.mkdir(parents=True)
    for rank, record in enumerate([{"rank": 0, "time": 2.0}, {"rank": 1, "time": 1.0},
                                   {"rank": "2", "time": 0.5}, [3]]):  # fmt: skip
        (folder / f"rank_{rank}.json").write_text(json.dumps(record))
    assert [r["rank"] for r in read_failures(tmp_path)] == [1, 0]
    assert schema_problem({"rank": 0}, FAILURE_SCHEMA) == "time: missing (a required field)"


def test_a_requeued_allocation_shows_its_own_step_and_loss(tmp_path):
    """The previous allocation stopped at step 40 (loss 4.743) and wrote summary.json; the
    requeued one resumed from its checkpoint (metrics.jsonl cut back to step 40) and is at
    step 64 with loss 2.96. Status shows 64 and 2.96, not the summary's 4.743."""
    job_dir = tmp_path / "requeued"
    job_dir.mkdir()
    record = local_record(job_dir, "999999991", "running", steps=100)
    write_record_file(job_dir, {**record, "machine": "slurm_local", "scheduler": "slurm"})
    first = {s: 6.0 - s * 0.03 for s in range(1, 41)}
    write_metrics(job_dir, first, tokens_per_s=5000.0)
    write_summary(job_dir, {"steps": 40, "final_loss": 4.743, "tokens_per_s": 5000.0,
                            "step_time_s": 0.1, "stopped": True})  # fmt: skip
    before = time.time() - 120  # the previous allocation ended two minutes ago
    os.utime(JobPaths(job_dir).summary, (before, before))
    write_metrics(
        job_dir,
        {**first, **{s: 2.96 + (64 - s) * 0.01 for s in range(41, 65)}},
        tokens_per_s=1234.0,
    )  # the requeued allocation, resumed from step 40

    (row,) = json.loads(status(job_dir, "--json").stdout)
    assert (row["step"], row["loss"], row["tokens_per_s"]) == (64, 2.96, 1234.0), row
    table = status(job_dir).stdout.splitlines()[1]
    assert "64/100" in table and "2.96" in table and "4.743" not in table, table

    # just requeued: metrics.jsonl cut back to the checkpoint, after the summary was written
    write_metrics(job_dir, first, tokens_per_s=777.0)
    assert run_results(job_dir).tokens_per_s == 777.0
    # a run that finished writes its summary after its last row: the summary stands
    write_summary(job_dir, {"steps": 100, "final_loss": 2.1, "tokens_per_s": 1500.0})
    assert run_results(job_dir).loss == 2.1


def test_a_job_is_ours_only_with_its_name_and_an_output_inside_its_dir(tmp_path):
    """``jobs stop``'s check before scancel (submit/chain.py); on the cluster in
    tests/slurm/test_ownership.py."""
    job_dir = tmp_path / "run"
    ours = f"{job_dir}/slurm/%j/%j_0_log.out"
    assert ownership_problem(job_dir, "gpt_tiny-local", "gpt_tiny-local", ours) == ""
    recovery = f"{job_dir}/logs/recovery_%j.log"
    assert ownership_problem(job_dir, "n-recovery", "n-recovery", recovery) == ""
    assert ownership_problem(job_dir, "a", "wrap", ours) == "its name is 'wrap', not 'a'"
    elsewhere = f"{tmp_path}/run2/slurm/%j/%j_0_log.out"  # a sibling dir sharing the prefix
    assert ownership_problem(job_dir, "a", "a", elsewhere) == (
        f"its output goes to {elsewhere}, outside this dir"
    )
    both = ownership_problem(job_dir, "a", "wrap", "/home/u/slurm-%j.out")
    assert both == (
        "its name is 'wrap', not 'a' and its output goes to /home/u/slurm-%j.out, outside this dir"
    )
