"""The startup record in each job's log: where the ranks run and what each one found.

Every rank logs one line (host, torch, the devices it sees, the collective backend and the
network plugin that backend loaded); rank 0 also logs the whole job, host by host. Each
record names the rank's node (``SLURMD_NODENAME``, else the host name), the name
``--exclude`` takes.

Why the plugin is checked and how it is found: ``docs/recovery.md``
("train/health/startup.py").
"""

from __future__ import annotations

import logging
import os
import re
import socket
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from axonn_launch.common.jobdir import JobPaths
from axonn_launch.common.ranks import node_name
from axonn_launch.train.parallel.bootstrap import DistEnv, launcher_words

log = logging.getLogger(__name__)

# aws-ofi-nccl installs libnccl-net.so / libnccl-net-ofi.so (RCCL: librccl-net.so); older
# builds and site modules name the library or its folder after aws-ofi.
PLUGIN_LIBRARY = re.compile(
    r"/(?:lib(?:nccl|rccl)-net[\w.-]*\.so[\w.]*|[^\s]*aws-ofi[^\s]*\.so[\w.]*)$"
)
PLUGIN_ENV = ("NCCL_NET_PLUGIN", "NCCL_NET")
# NCCL and RCCL log "<host>:<pid>:<tid> [<dev>] NCCL INFO Using network <NAME>" once per
# communicator (init.cc); aws-ofi-nccl's NAME is Libfabric, "AWS Libfabric" or OFI
NCCL_NETWORK = re.compile(r"NCCL INFO Using network (?P<name>\S.*?)\s*$", re.M)


def enable_nccl_log(job_dir: str | Path, rank: int, environ=os.environ) -> None:
    """Before NCCL starts: have it write its INIT and NET lines to
    ``<job_dir>/logs/nccl_rank<R>.log``. Variables the user set are left as they are.
    NCCL's WARN lines go there too, not to stderr: ``jobs status`` reads them there."""
    environ.setdefault("NCCL_DEBUG", "INFO")
    environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    path = JobPaths(job_dir).nccl_log(rank)
    environ.setdefault("NCCL_DEBUG_FILE", str(path))


def nccl_log_path(environ: Mapping[str, str], pid: int, host: str) -> Path | None:
    """The file NCCL_DEBUG_FILE names for this process (NCCL expands %h and %p)."""
    template = environ.get("NCCL_DEBUG_FILE")
    if not template:
        return None
    return Path(template.replace("%h", host).replace("%p", str(pid)))


def nccl_networks(log_text: str) -> list[str]:
    """The networks NCCL says it uses, from its log, each once, in order."""
    found: list[str] = []
    for match in NCCL_NETWORK.finditer(log_text):
        if match["name"] not in found:
            found.append(match["name"])
    return found


def chosen_network(backend: str, environ: Mapping[str, str] = os.environ) -> str:
    """What NCCL's log says it chose in this process; "" when there is no such log."""
    path = nccl_log_path(environ, os.getpid(), socket.gethostname())
    if backend == "gloo" or path is None:
        return ""
    try:
        return ", ".join(nccl_networks(path.read_text(errors="replace")))
    except OSError:
        return ""


def plugin_libraries(maps_text: str) -> list[str]:
    """Paths of NCCL/RCCL network plugins in ``/proc/<pid>/maps`` text, each once."""
    found: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset device inode path
        path = fields[5].strip() if len(fields) == 6 else ""
        if PLUGIN_LIBRARY.search(path) and path not in found:
            found.append(path)
    return found


def network_plugin(
    backend: str, maps_text: str, environ: Mapping[str, str], chosen: str = ""
) -> str:
    """What carries this rank's collectives across nodes, in words."""
    if backend == "gloo":
        return "gloo, no network plugin"
    libraries = plugin_libraries(maps_text)
    loaded = ", ".join(libraries) if libraries else "none loaded (NCCL's own sockets/IB)"
    asked = ", ".join(f"{key}={environ[key]!r}" for key in PLUGIN_ENV if environ.get(key))
    using = f"; NCCL uses network {chosen}" if chosen else ""
    return f"{_nccl_name()}, plugin: {loaded}{using}" + (f"; {asked}" if asked else "")


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


def rank_record(env: DistEnv) -> dict:
    maps = Path("/proc/self/maps")
    maps_text = maps.read_text() if maps.exists() else ""
    chosen = chosen_network(env.backend)
    return {
        "rank": env.rank,
        "launcher": launcher_words(env),
        "host": socket.gethostname(),
        "node": node_name(),
        "torch": torch.__version__,
        "devices": devices_seen(env.device),
        "network": network_plugin(env.backend, maps_text, os.environ, chosen),
        "nccl_network": chosen,  # "" without NCCL's log
        "plugin_libraries": plugin_libraries(maps_text) if env.backend != "gloo" else [],
    }


def log_startup(env: DistEnv) -> list[dict]:
    """Log the startup record; every rank must call it (it runs two collectives)."""
    dist.barrier()  # the first collective: NCCL/RCCL load their network plugin here
    mine = rank_record(env)
    log.info(
        "startup: ranks from %s; torch %s; devices: %s; network: %s",
        mine["launcher"],
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
    for record in records:  # by node: Slurm's name where the host names are all one
        hosts.setdefault(str(record.get("node") or record["host"]), []).append(record)
    on = f"{len(hosts)} host{'' if len(hosts) == 1 else 's'}"
    lines = [f"{len(records)} ranks on {on}: {', '.join(hosts)}"]
    for host, ranks in hosts.items():
        seen = {
            f"{r['devices']}; network: {r['network']}; torch {r['torch']}"
            + (f"; ranks from {r['launcher']}" if r.get("launcher") else "")
            for r in ranks
        }
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


def interpreter_words(environ: Mapping[str, str] = os.environ) -> str:
    """Which Python this rank runs, and where it came from."""
    source = environ.get("AXONN_PYTHON_FROM")
    where = f"copied to node-local storage from {source}" if source else "as installed"
    return f"{sys.executable} ({where})"


def seconds_since_srun(environ: Mapping[str, str] = os.environ) -> float | None:
    """Seconds since the batch script started srun (``AXONN_SRUN_START``), or None."""
    try:
        return time.time() - float(environ["AXONN_SRUN_START"])
    except (KeyError, ValueError):
        return None


def log_startup_time(env: DistEnv) -> dict:
    """Every rank, as training starts: how long it took from srun to here and which Python
    it runs; rank 0 logs the median and names the slowest rank. Returns the job's record
    (the same on every rank)."""
    mine = {"rank": env.rank, "node": node_name(), "seconds": seconds_since_srun()}
    everyone: list = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    record = {"interpreter": interpreter_words()}
    timed = [r for r in everyone if r["seconds"] is not None]
    if timed:
        slowest = max(timed, key=lambda r: r["seconds"])
        record |= {
            "srun_to_training_s": {
                "median": statistics.median(r["seconds"] for r in timed),
                "slowest": slowest,
            },
            "ranks_timed": len(timed),
        }
    if env.rank == 0:
        log.info("startup: interpreter %s", record["interpreter"])
        if timed:
            took = record["srun_to_training_s"]
            log.info(
                "startup: srun to training: median %.1f s; slowest rank %d on %s: %.1f s",
                took["median"],
                slowest["rank"],
                slowest["node"],
                slowest["seconds"],
            )
    return record
