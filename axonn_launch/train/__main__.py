"""``python -m axonn_launch.train <job_dir>``: run one rank of the job in ``job_dir``.

The launcher starts one such process per rank with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (or under srun / mpirun, which
``bootstrap`` understands too); ``<job_dir>/spec.json`` holds the ``JobSpec``.
``AXONN_FAULT`` injects faults here as in Slurm jobs (``axonn_launch.train.health.faults``).

SIGUSR2 asks this rank to save a checkpoint at the next step boundary and stop, as it asks
a Slurm task (``submit/task.py``): a local job's supervisor sends it on a first Ctrl-C
(``scheduler/processes.py``). The rank then ends with code 0, its summary saying ``stopped``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from axonn_launch.common.fserrors import file_system_line
from axonn_launch.common.jobdir import JobPaths, attempt_number, checkpointed_step
from axonn_launch.common.ranks import environment_rank
from axonn_launch.common.spec import JobSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m axonn_launch.train")
    parser.add_argument("job_dir", type=Path, help="directory holding spec.json")
    args = parser.parse_args(argv)
    from axonn_launch.train import run_job
    from axonn_launch.train.health.faults import StopFlag, step_hook

    stop = StopFlag()
    signal.signal(signal.SIGUSR2, stop.request)

    rank = environment_rank(os.environ).rank
    start, attempt = checkpointed_step(args.job_dir), attempt_number(args.job_dir)
    hook = step_hook(stop, rank=rank, start_step=start, attempt=attempt)
    try:
        run_job(JobSpec.load(JobPaths(args.job_dir).spec), should_stop=hook)
    except Exception as error:
        if file_system_line(error) is None:
            raise  # a bug's traceback is what its reader needs
        return 1  # run_job logged one line and recorded it: the file system needs no traceback
    return 0


if __name__ == "__main__":
    sys.exit(main())
