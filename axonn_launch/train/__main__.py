"""``python -m axonn_launch.train <job_dir>``: run one rank of the job in ``job_dir``.

The launcher starts one such process per rank with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (or under srun / mpirun, which
``bootstrap`` understands too); ``<job_dir>/spec.json`` holds the ``JobSpec``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from axonn_launch.spec import JobSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m axonn_launch.train")
    parser.add_argument("job_dir", type=Path, help="directory holding spec.json")
    args = parser.parse_args(argv)
    from axonn_launch.train import run

    run(JobSpec.load(args.job_dir / "spec.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
