"""machine=local: start one process per rank on this computer, torchrun-style."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from axonn_launch.common.jobdir import JobPaths


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(
    *,
    rank: int,
    world_size: int,
    port: int,
    extra: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one local rank process: ``base`` (default: this process's),
    ``extra``, then the torchrun-style rendezvous variables."""
    env = dict(os.environ if base is None else base)
    env.update(extra or {})
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


def starting_line(world_size: int) -> str:
    """Printed as the ranks start: until rank 0 logs, seconds pass (a minute and more on
    a run whose Python has no compiled bytecode yet: the first after a plain install)."""
    wait = "" if bytecode_cached() else "; the first run compiles Python: up to a minute"
    return f"starting {world_size} ranks (rank 0 logs here, the others to logs/rank_<N>.log){wait}"


def bytecode_cached(modules: tuple[str, ...] = ("torch", "axonn_launch.train")) -> bool:
    """Whether the packages the ranks import have their ``__pycache__`` (compiled by
    machines/local/setup.sh, or by an earlier run); looked up without importing them."""
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return False
        origin = spec.origin if spec else None
        if not origin or not os.path.exists(importlib.util.cache_from_source(origin)):
            return False
    return True


def start_ranks(*, job_dir: Path, world_size: int, env: dict[str, str]) -> list[subprocess.Popen]:
    """Rank 0 keeps this terminal; the others' output goes to <job_dir>/logs/rank_<N>.log,
    opened for appending: each rank's logging (train/logs.py) appends its lines there too."""
    paths = JobPaths(job_dir)
    paths.logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [sys.executable, "-m", "axonn_launch.train", str(job_dir)]
    procs = []
    for rank in range(world_size):
        out = None if rank == 0 else open(paths.rank_log(rank), "a")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                command,
                env=rank_env(rank=rank, world_size=world_size, port=port, extra=env),
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
            )
        )
    return procs


def wait_ranks(procs: list[subprocess.Popen]) -> int:
    """Wait for all ranks; when one fails, stop the rest (as srun --kill-on-bad-exit)."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                stop(procs)
                return failed[0] if failed[0] > 0 else 128 - failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        stop(procs)
        return 130


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
