"""The startup record in each job's log: where the ranks run and what each one found.

Every rank logs one line (host, torch, the devices it sees, the collective backend and the
network plugin that backend loaded); rank 0 also logs the whole job, host by host. The
sites ask users to check the plugin (CSCS, NERSC: ``NCCL_DEBUG=INFO`` shows ``Using network
AWS Libfabric``), because NCCL silently falls back to TCP sockets without it. NCCL and
RCCL load their plugin when the first communicator is made, so the record is taken after
the process group's first collective, from the shared libraries mapped into the process.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from axonn_launch.train.bootstrap import DistEnv

log = logging.getLogger(__name__)

# aws-ofi-nccl installs libnccl-net.so / libnccl-net-ofi.so (RCCL: librccl-net.so); older
# builds and site modules name the library or its folder after aws-ofi.
PLUGIN_LIBRARY = re.compile(
    r"/(?:lib(?:nccl|rccl)-net[\w.-]*\.so[\w.]*|[^\s]*aws-ofi[^\s]*\.so[\w.]*)$"
)
PLUGIN_ENV = ("NCCL_NET_PLUGIN", "NCCL_NET")


def plugin_libraries(maps_text: str) -> list[str]:
    """Paths of NCCL/RCCL network plugins in ``/proc/<pid>/maps`` text, each once."""
    found: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset device inode path
        path = fields[5].strip() if len(fields) == 6 else ""
        if PLUGIN_LIBRARY.search(path) and path not in found:
            found.append(path)
    return found


def network_plugin(backend: str, maps_text: str, environ: Mapping[str, str]) -> str:
    """What carries this rank's collectives across nodes, in words."""
    if backend == "gloo":
        return "gloo, no network plugin"
    libraries = plugin_libraries(maps_text)
    loaded = ", ".join(libraries) if libraries else "none loaded (NCCL's own sockets/IB)"
    asked = ", ".join(f"{key}={environ[key]!r}" for key in PLUGIN_ENV if environ.get(key))
    return f"{_nccl_name()}, plugin: {loaded}" + (f"; {asked}" if asked else "")


def devices_seen(device: str) -> str:
    """The accelerators this process sees, e.g. ``4 x NVIDIA GH200, using cuda:1``."""
    if not torch.cuda.is_available():
        return "no GPU (cpu)"
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    visible = {
        k: os.environ[k]
        for k in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
        if k in os.environ
    }
    where = ", ".join(f"{k}={v}" for k, v in visible.items())
    return f"{count} x {'/'.join(names)}, using {device}" + (f" ({where})" if where else "")


def rank_record(env: DistEnv) -> dict[str, str | int]:
    maps = Path("/proc/self/maps")
    maps_text = maps.read_text() if maps.exists() else ""
    return {
        "rank": env.rank,
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "devices": devices_seen(env.device),
        "network": network_plugin(env.backend, maps_text, os.environ),
    }


def log_startup(env: DistEnv) -> list[dict]:
    """Log the startup record; every rank must call it (it runs two collectives)."""
    dist.barrier()  # the first collective: NCCL/RCCL load their network plugin here
    mine = rank_record(env)
    log.info(
        "startup: torch %s; devices: %s; network: %s",
        mine["torch"],
        mine["devices"],
        mine["network"],
    )
    records: list = [None] * env.world_size
    dist.all_gather_object(records, mine)
    if env.rank == 0:
        for line in job_summary(records):
            log.info("startup: %s", line)
    return records


def job_summary(records: list[dict]) -> list[str]:
    """One line for the job, then one per host: its ranks and what they see."""
    hosts: dict[str, list[dict]] = {}
    for record in records:
        hosts.setdefault(str(record["host"]), []).append(record)
    lines = [f"{len(records)} ranks on {len(hosts)} hosts: {', '.join(hosts)}"]
    for host, ranks in hosts.items():
        seen = {f"{r['devices']}; network: {r['network']}; torch {r['torch']}" for r in ranks}
        numbers = ",".join(str(r["rank"]) for r in ranks)
        lines.append(f"{host}: ranks {numbers}: {' | '.join(sorted(seen))}")
    return lines


def _nccl_name() -> str:
    name = "rccl" if torch.version.hip else "nccl"
    try:
        version = ".".join(str(part) for part in torch.cuda.nccl.version())
    except Exception:  # a build without NCCL
        return name
    return f"{name} {version}"
