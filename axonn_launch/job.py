"""The callable submitit pickles and runs in every task of a Slurm job.

This module stays torch-free: the training core is imported only inside
``__call__``, on the compute node.
"""

from __future__ import annotations

import getpass
import os
from pathlib import Path


class TrainJob:
    """Run the training core for the job directory ``job_dir`` (holding spec.json)."""

    def __init__(self, job_dir: str, task_env: dict[str, str] | None = None) -> None:
        self.job_dir = job_dir
        self.task_env = dict(task_env or {})

    def __call__(self) -> dict:
        apply_task_env(self.task_env)
        from axonn_launch.spec import JobSpec
        from axonn_launch.train import run

        return run(JobSpec.load(Path(self.job_dir) / "spec.json"))


def apply_task_env(task_env: dict[str, str]) -> None:
    """Per-task variables, expanded in Python (never by a shell); creates /tmp dirs."""
    fields = {
        "user": os.environ.get("USER") or getpass.getuser(),
        "node_id": os.environ.get("SLURM_NODEID", "0"),
        "local_rank": os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", "0")),
    }
    for key, template in task_env.items():
        value = template.format(**fields)
        os.environ[key] = value
        if value.startswith("/tmp/"):
            Path(value).mkdir(parents=True, exist_ok=True)
