"""axonn_launch.api, as a notebook uses it: compose, plan, a dry run, a local launch that
waits, status, stop and a refused resubmission, in one fresh process that must never
import torch (the job's ranks run in their own processes); the bad inputs' one-line errors;
and docs/api.md's sweep, run as written."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from axonn_launch import api
from tests.cli_server import run_module
from tests.conftest import REPO

LOCAL_RUN = ["machine=local", "model=gpt_tiny", "train.steps=3", "train.sample_tokens=0",
             "train.progress=false", "grid.x=2"]  # fmt: skip

NOTEBOOK = textwrap.dedent(
    """
    import json, sys
    from axonn_launch import api

    said = {}
    config = api.compose(sys.argv[1:])
    said["typed"] = [config.launch.name, config.launch.train.steps, config.launch.grid.x]
    said["plans"] = api.plan(config, top=2)["plans"]
    dry = api.launch(config, dry_run=True, out=open("dry.txt", "w"))
    said["dry"] = [dry.outcome, str(dry.job_dir), api.status(dry.job_dir).state]
    said["torch_before_job"] = "torch" in sys.modules
    job = api.launch(config, wait=True, out=open("run.txt", "w"))
    row = job.wait(timeout_s=60)
    said["job"] = [job.outcome, list(job.job_ids), str(job.job_dir)]
    said["status"] = [row.state, row.step, row.steps, row.failure, row.loss]
    said["stop"] = api.stop(job.job_dir)
    try:
        api.resubmit(job.job_dir)
    except api.LaunchError as error:
        said["resubmit"] = str(error)
    said["torch_after_job"] = "torch" in sys.modules
    print(json.dumps(said))
    """
)


@pytest.fixture(scope="module")
def notebook(tmp_path_factory) -> dict:
    """One fresh process drives the API end to end; what it saw, as JSON."""
    cwd = tmp_path_factory.mktemp("notebook")
    done = subprocess.run([sys.executable, "-c", NOTEBOOK, *LOCAL_RUN], cwd=cwd,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "cwd": cwd}


def test_compose_and_plan_give_typed_config_and_rows(notebook):
    assert notebook["typed"] == ["gpt_tiny-local", 3, 2]
    plans = notebook["plans"]
    assert [p["rank"] for p in plans] == [1, 2]
    assert set(plans[0]["grid"]) == {"data", "x", "y", "z"}


def test_dry_run_writes_job_dir_under_jobs(notebook):
    outcome, job_dir, state = notebook["dry"]
    assert (outcome, state) == ("dry_run", "DRY_RUN")
    assert Path(job_dir).parent == notebook["cwd"] / "jobs" / "gpt_tiny-local"
    assert "--- local command ---" in (notebook["cwd"] / "dry.txt").read_text()


def test_local_launch_waits_and_status_reads_it(notebook):
    outcome, job_ids, job_dir = notebook["job"]
    assert outcome == "completed" and job_ids[0].startswith("local-")
    state, step, steps, failure, loss = notebook["status"]
    assert (state, step, steps, failure) == ("COMPLETED", 3, 3, "completed")
    assert loss is not None
    record = json.loads((Path(job_dir) / "job.json").read_text())
    assert record["command_line"][1:] == [*LOCAL_RUN, "wait=true"]  # what resubmit composes


def test_stop_and_refused_resubmit_are_one_line(notebook):
    assert notebook["stop"].startswith("stopped ")
    assert "\n" not in notebook["resubmit"] and notebook["resubmit"]


def test_api_process_never_imports_torch(notebook):
    assert not notebook["torch_before_job"] and not notebook["torch_after_job"]


def test_bad_override_raises_the_launchers_line(tmp_path):
    cli = run_module("axonn_launch", ["train.stepz=3"], cwd=tmp_path, timeout=120)
    with pytest.raises(api.LaunchError) as raised:
        api.compose(["train.stepz=3"])
    assert cli.returncode == 2 and cli.stderr.strip() == f"error: {raised.value}"


def test_bad_grid_raises_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = api.compose(["model=gpt_tiny", "grid.x=7"])
    with pytest.raises(api.LaunchError, match=r"^grid\.x=7: must divide"):
        api.launch(config, dry_run=True)
    with pytest.raises(api.LaunchError, match="not a directory"):
        api.compose([], site=tmp_path / "no-such-site")
    assert list(tmp_path.iterdir()) == []


def doc_sweep() -> str:
    """docs/api.md's notebook sweep: its python block with the loop over lr values."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "api.md").read_text(), re.S)
    return next(b for b in blocks if "for lr in" in b)


def test_docs_sweep_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(doc_sweep(), "docs/api.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.count(": DRY_RUN data=1 x=2") == 2
    runs = sorted((tmp_path / "jobs" / "gpt_tiny-local").iterdir())
    lrs = [json.loads((r / "job.json").read_text())["command_line"] for r in runs]
    assert {c[-3] for c in lrs} == {"train.lr=0.001", "train.lr=0.003"}


def test_a_site_dir_is_used_as_axonn_site_dir_uses_it(tmp_path, monkeypatch):
    """``compose(site=DIR)`` reads DIR as ``AXONN_SITE_DIR=DIR`` does: its profile of a
    packaged name wins (``--config-dir`` would not), its accounts apply, and the launch
    records it in job.json for a resubmission; the environment is left as it was."""
    site = tmp_path / "site"
    (site / "machine").mkdir(parents=True)
    (site / "local").mkdir()
    packaged = (REPO / "axonn_launch" / "conf" / "machine" / "frontier.yaml").read_text()
    (site / "machine" / "frontier.yaml").write_text(
        packaged.replace("partition: batch", "partition: site_batch")
    )
    (site / "local" / "default.yaml").write_text(
        "# @package _global_\nsite:\n  accounts:\n    frontier: site-acct\n"
    )
    monkeypatch.delenv("AXONN_SITE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    config = api.compose(["machine=frontier", "model=gpt_tiny"], site=site)
    assert config.launch.machine.slurm.partition == "site_batch"
    assert config.launch.site.accounts["frontier"] == "site-acct"
    assert config.site == str(site)
    job = api.launch(config, dry_run=True, out=io.StringIO())
    assert json.loads((job.job_dir / "job.json").read_text())["site_dir"] == str(site)
    assert "AXONN_SITE_DIR" not in os.environ
    plain = api.compose(["machine=frontier", "model=gpt_tiny"])
    assert plain.launch.machine.slurm.partition == "batch" and plain.site is None
