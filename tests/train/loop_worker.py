"""One rank of a training job whose ``should_stop`` fires after a given number of steps.

Usage: python -m tests.train.loop_worker <job_dir> [--stop-after K] [--stop-rank R]
The stop request is made on rank R only; the loop must agree on it across ranks.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from axonn_launch.common.spec import JobSpec
from axonn_launch.train import run_job


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job_dir", type=Path)
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("--stop-rank", type=int, default=0)
    args = parser.parse_args()
    calls = 0
    is_stopping_rank = int(os.environ.get("RANK", "0")) == args.stop_rank

    def should_stop() -> bool:
        nonlocal calls
        calls += 1
        return is_stopping_rank and args.stop_after > 0 and calls >= args.stop_after

    summary = run_job(JobSpec.load(args.job_dir / "spec.json"), should_stop=should_stop)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
