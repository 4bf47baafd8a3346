"""Run by the bootstrap tests in each launched process: bootstrap, join gloo, all-reduce.

Usage: python -m tests.train.bootstrap_worker <master_port> [<out_dir>]; prints one JSON
line, or writes it to ``<out_dir>/rank<r>.json`` (mpirun merges the ranks' stdout, and two
ranks' lines can arrive joined into one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from axonn_launch.common.spec import RuntimeConfig
from axonn_launch.train.parallel.bootstrap import discover_env, init_distributed


def main() -> None:
    env = discover_env(RuntimeConfig(master_port=int(sys.argv[1]), device="cpu"))
    init_distributed(env, timeout_s=60)
    value = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(value)
    report = {
        "rank": env.rank,
        "world_size": env.world_size,
        "local_rank": env.local_rank,
        "local_world_size": env.local_world_size,
        "source": env.source,
        "backend": env.backend,
        "device": env.device,
        "master_addr": env.master_addr,
        "sum": value.item(),
    }
    if len(sys.argv) > 2:
        (Path(sys.argv[2]) / f"rank{env.rank}.json").write_text(json.dumps(report))
    else:
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
