"""The startup record: every rank's line and rank 0's job summary, from real gloo ranks."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import torch

from axonn_launch.train.health.startup import (
    job_summary,
    log_startup,
    network_plugin,
    plugin_libraries,
)
from axonn_launch.train.parallel.bootstrap import DistEnv
from tests.train.dist_utils import run_world

# lines of a real /proc/<pid>/maps of an NCCL job with the aws-ofi-nccl plugin loaded
NCCL_JOB_MAPS = """\
7f2a1c000000-7f2a1c021000 rw-p 00000000 00:00 0
7f2a1d200000-7f2a1d3c5000 r-xp 00000000 00:2f 1234 /opt/aws-ofi-nccl/lib/libnccl-net.so
7f2a1d3c5000-7f2a1d5c4000 ---p 001c5000 00:2f 1234 /opt/aws-ofi-nccl/lib/libnccl-net.so
7f2a1e000000-7f2a2a000000 r-xp 00000000 00:2f 99 /usr/lib/x86_64-linux-gnu/libnccl.so.2.27.3
7f2a2b000000-7f2a2b100000 r-xp 00000000 00:2f 77 /opt/rocm/lib/librccl-net.so
"""


def test_plugin_libraries_finds_the_network_plugin_once_and_not_nccl_itself():
    assert plugin_libraries(NCCL_JOB_MAPS) == [
        "/opt/aws-ofi-nccl/lib/libnccl-net.so",
        "/opt/rocm/lib/librccl-net.so",
    ]


def test_this_cpu_process_has_no_network_plugin_mapped():
    assert plugin_libraries(Path("/proc/self/maps").read_text()) == []


def test_network_plugin_in_words():
    assert network_plugin("gloo", NCCL_JOB_MAPS, {}) == "gloo, no network plugin"
    words = network_plugin("nccl", NCCL_JOB_MAPS, {"NCCL_NET": "AWS Libfabric"})
    assert "plugin: /opt/aws-ofi-nccl/lib/libnccl-net.so" in words
    assert words.endswith("NCCL_NET='AWS Libfabric'")
    assert "none loaded" in network_plugin("nccl", "", {})


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def startup_worker(rank: int, world_size: int) -> tuple[list[dict], list[str]]:
    capture = _Capture()
    logger = logging.getLogger("axonn_launch.train.health.startup")
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    env = DistEnv(rank, rank, world_size, world_size, "127.0.0.1", 0, "cpu", "gloo", "torchrun")
    records = log_startup(env)
    return records, capture.lines


def test_every_rank_logs_its_record_and_rank_0_the_whole_job():
    results = run_world(startup_worker, 3, timeout=120)
    host = socket.gethostname()
    for rank, (records, lines) in enumerate(results):
        assert [r["rank"] for r in records] == [0, 1, 2]
        assert {r["host"] for r in records} == {host}
        assert lines[0] == (
            f"startup: ranks from torchrun; torch {torch.__version__}; devices: no GPU (cpu); "
            "network: gloo, no network plugin"
        )
        assert len(lines) == (3 if rank == 0 else 1)
    summary = results[0][1][1:]
    assert summary[0] == f"startup: 3 ranks on 1 host: {host}"
    assert summary[1].startswith(f"startup: {host}: ranks 0,1,2: no GPU (cpu); network: gloo")


def test_job_summary_groups_ranks_by_host():
    records = [
        {"rank": r, "host": f"nid{r // 2}", "torch": "2.9", "devices": "d", "network": "n"}
        for r in range(4)
    ]
    assert job_summary(records) == [
        "4 ranks on 2 hosts: nid0, nid1",
        "nid0: ranks 0,1: d; network: n; torch 2.9",
        "nid1: ranks 2,3: d; network: n; torch 2.9",
    ]
    pmix = [{**r, "launcher": "slurm step (srun --mpi=pmix)"} for r in records]
    assert job_summary(pmix)[1] == (
        "nid0: ranks 0,1: d; network: n; torch 2.9; ranks from slurm step (srun --mpi=pmix)"
    )


def test_threads_per_rank_given_or_the_cores_shared_among_the_local_ranks():
    from axonn_launch.train.run import configure_threads

    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        local = DistEnv(0, 0, 2, 2, "127.0.0.1", 0, "cpu", "gloo", "torchrun")
        configure_threads(local, threads=3)
        assert torch.get_num_threads() == 3
        configure_threads(local)  # 0: this node's cores over its 2 ranks
        assert torch.get_num_threads() == max(1, cores // 2)
        bound = DistEnv(0, 0, 2, 2, "127.0.0.1", 0, "cpu", "gloo", "slurm")
        configure_threads(bound, environ={})  # a Slurm task: the cores it is bound to
        assert torch.get_num_threads() == cores
        configure_threads(bound, environ={"SLURM_CPUS_PER_TASK": "1"})  # and no more than given
        assert torch.get_num_threads() == 1
        configure_threads(bound, environ={"SLURM_CPUS_PER_TASK": str(cores + 4)})
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)
