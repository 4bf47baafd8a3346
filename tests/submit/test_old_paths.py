"""Jobs pickled before the package moved into folders still run after it.

``tests/fixtures/trainjob_before_relayout.pkl`` was written by the code of commit be55d50
(before the re-layout): submitit's ``DelayedSubmission`` of that code's
``axonn_launch.job.TrainJob``, pickled as submitit does when it submits or requeues a job
(protocol 0 here, so that the test can put its own job dir into the text). Unpickling it
with today's code must find the class at its new home, and calling it must train the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from axonn_launch.common.jobdir import JobPaths
from tests.conftest import REPO

FIXTURE = Path(__file__).parents[1] / "fixtures" / "trainjob_before_relayout.pkl"

RUN_OLD_PICKLE = """
import os, pickle, sys
from axonn_launch.submit.task import TrainJob
submission = pickle.loads(open(sys.argv[1], "rb").read())
assert type(submission.function) is TrainJob, type(submission.function)
summary = submission.result()
print("steps", summary["steps"], "env", os.environ["AXONN_TEST_TASK_ENV"])
"""


def test_a_job_pickled_before_the_move_runs_after_it(tmp_path):
    job_dir = tmp_path / "job"
    launch = subprocess.run(
        [sys.executable, "-m", "axonn_launch", "machine=local", "model=gpt_tiny",
         "grid.x=1", "grid.z=1", "train.steps=2", "dry_run=true", f"hydra.run.dir={job_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert launch.returncode == 0, launch.stderr[-2000:]
    assert JobPaths(job_dir).spec.is_file()
    text = FIXTURE.read_text(encoding="latin-1")
    assert "caxonn_launch.job\nTrainJob" in text  # the old module path, as pickled then
    pickled = tmp_path / "submitted.pkl"
    pickled.write_text(text.replace("@JOB_DIR@", str(job_dir)), encoding="latin-1")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}  # fmt: skip
    env.pop("SLURM_JOB_ID", None)
    run = subprocess.run(
        [sys.executable, "-c", RUN_OLD_PICKLE, str(pickled)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "steps 2 env from-the-old-pickle" in run.stdout
    summary = json.loads(JobPaths(job_dir).summary.read_text())
    assert summary["steps"] == 2


def test_the_pickled_path_is_the_one_old_path_kept():
    """``axonn_launch.job.TrainJob`` is today's class itself, through a plain module: no
    finder on ``sys.meta_path``, and the old paths no job ever pickled are gone."""
    import importlib.util

    import axonn_launch
    from axonn_launch.job import TrainJob as old
    from axonn_launch.submit.task import TrainJob

    assert old is TrainJob
    finders = [f for f in sys.meta_path if type(f).__module__.startswith(axonn_launch.__name__)]
    assert not finders, finders
    assert importlib.util.find_spec("axonn_launch.grid") is None


# What batch scripts already queued on a cluster run, by module (``python -m``): the
# restart decision (render.py's in-place loop), the recovery job (chain.py's script) and a
# pack's allocation (pack.py); each still answers, with its usage line when given nothing.
QUEUED_ENTRIES = {
    "axonn_launch.restart": "usage: python -m axonn_launch.restart <job_dir> <exit status>",
    "axonn_launch.recover": "usage: python -m axonn_launch.recover <attempt dir>",
    "axonn_launch.pack": "usage: python -m axonn_launch.pack <pack dir>",
}


def test_each_entry_a_queued_script_names_still_runs():
    """The module entries, and the callables submitit pickled (``submit.task.TrainJob``, the
    older ``job.TrainJob``), are where queued jobs look for them."""
    code = (
        "import runpy, sys\n"
        "for name in sys.argv[1:]:\n"
        "    sys.argv = [name]\n"
        "    try:\n"
        "        runpy.run_module(name, run_name='__main__')\n"
        "    except SystemExit as end:\n"
        "        print(name, 'exit', end.code, flush=True)\n"
        "from axonn_launch.job import TrainJob as old\n"
        "from axonn_launch.submit.task import TrainJob\n"
        "print('TrainJob', old is TrainJob, TrainJob.__module__)\n"
    )
    run = subprocess.run([sys.executable, "-c", code, *QUEUED_ENTRIES], cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    for name, usage in QUEUED_ENTRIES.items():
        assert f"{name} exit 2" in run.stdout, run.stdout
        assert usage in run.stderr
    assert "TrainJob True axonn_launch.submit.task" in run.stdout
