"""The job, not ``jobs status``, writes the run's goodput into its TensorBoard folder when
the run ends: a local run's supervisor does (``batch/supervise.py`` through
``records/curves.py``). One short real run; nothing runs ``jobs status`` before the check,
and the figures written are the ones ``jobs status`` then gives."""

from __future__ import annotations

import json
import subprocess
import sys

from axonn_launch.records.curves import TAGS
from tests.conftest import run_launcher
from tests.submit.test_local_supervisor import poll
from tests.train.tracker_files import as_float32, tb_series

RUN = ["machine=local", "model=gpt_tiny", "train.steps=3", "train.warmup_steps=0",
       "train.sample_tokens=0", "train.progress=false", "train.gemm_tuning=false",
       "wait=true"]  # fmt: skip


def test_a_run_that_ends_has_its_goodput_in_tensorboard_without_jobs_status(tmp_path):
    root = tmp_path / "run"
    launched = run_launcher([*RUN, f"hydra.run.dir={root}"], cwd=tmp_path, timeout=300)
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    assert "goodput not written" not in launched.stderr, launched.stderr[-2000:]
    # the launcher follows the run to its end (job.json final), and the supervisor writes
    # the goodput just after that record: wait for the supervisor, not for the launcher
    goodput = root / "tensorboard" / "goodput.json"
    poll(goodput.is_file, 60, "the supervisor's goodput record")
    written = json.loads(goodput.read_text())
    assert written["step"] == 3 and 0 < written["goodput"] <= 1, written
    for tag in ("goodput", "useful_s", "node_hours"):
        assert tb_series(root / "tensorboard", f"goodput/{tag}") == [
            (3, as_float32(written[tag]))
        ], tag
    status = subprocess.run([sys.executable, "-m", "axonn_launch.jobs", "status", str(root),
                             "--json"], capture_output=True, text=True, timeout=120)  # fmt: skip
    (row,) = json.loads(status.stdout)
    assert {t: row["goodput"][t] for t in TAGS} == {t: written[t] for t in TAGS}
    assert tb_series(root / "tensorboard", "goodput/goodput") == [
        (3, as_float32(written["goodput"]))
    ]  # jobs status found it written: not again
