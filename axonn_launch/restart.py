"""``python -m axonn_launch.restart <job_dir> <exit status>``: run by a Slurm job's batch
script after its training step failed; prints the next step's srun options, or exits 1
when the job is to end (``batch/restart.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

from axonn_launch.batch.restart import run_decision

if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[2].isdigit():
        print("usage: python -m axonn_launch.restart <job_dir> <exit status>", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_decision(Path(sys.argv[1]), int(sys.argv[2])))
