"""The emulated scale cluster (machines/slurm_scale) from Python: start, stop, the lock.

Every start, stop and job on it is taken under ``/tmp/axonn-slurm.lock`` (the same lock as
``flock /tmp/axonn-slurm.lock``), so that its load never meets another engineer's Slurm
test: hundreds of slurmd starting can make the test cluster's slurmd miss its 10 s
``SlurmdTimeout``. No torch.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCALE = REPO / "machines" / "slurm_scale"
SLURM_CONF = "/etc/slurm-scale/slurm.conf"  # lib.sh: SLURM_CONF_DIR/slurm.conf
STATE_DIR = Path("/var/lib/axonn-slurm-scale")  # lib.sh: STATE_DIR
SLURM_LOCK = Path("/tmp/axonn-slurm.lock")
PARTITION = "batch"  # conf/machine/frontier.yaml slurm.partition, as start.sh reads it


def slurm_env() -> dict[str, str]:
    """This process's environment, its Slurm commands pointed at the scale instance."""
    return {**os.environ, "SLURM_CONF": SLURM_CONF}


@contextmanager
def slurm_lock() -> Iterator[None]:
    """The machine's Slurm lock, held exclusively (``flock``'s own)."""
    with open(SLURM_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _timed_script(script: str, *args: str, timeout: float) -> dict[str, float]:
    """Runs ``machines/slurm_scale/<script>``; the ``name=seconds`` figures it prints."""
    proc = subprocess.run(
        ["bash", str(SCALE / script), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-8:])
        raise RuntimeError(f"{script} {' '.join(args)} exited {proc.returncode}:\n{tail}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(("start_s", "stop_s")))
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)}


def start(nodes: int, site: str = "frontier") -> dict[str, float]:
    """Starts ``nodes`` nodes of ``site``'s shape and waits for every one idle; the phases'
    seconds (total, slurmctld, slurmd_spawn, registered_idle)."""
    return _timed_script("start.sh", str(nodes), "--site", site, timeout=300 + nodes)


def stop() -> dict[str, float]:
    """Stops the instance; its seconds (total)."""
    return _timed_script("stop.sh", timeout=300)


def clear_node_local() -> None:
    """Empties every node's local storage (the broadcast copies of earlier jobs)."""
    for folder in STATE_DIR.glob("local-*"):
        subprocess.run(["rm", "-rf", *map(str, folder.iterdir())], check=False, timeout=300)


def slurmd_memory_mb() -> tuple[int, float]:
    """The scale instance's slurmd: how many, and their summed resident memory in MB."""
    total, count = 0, 0
    for pidfile in Path("/run/axonn-slurm-scale").glob("slurmd-*.pid"):
        try:
            status = Path(f"/proc/{pidfile.read_text().strip()}/status").read_text()
        except (OSError, ValueError):
            continue
        rss = re.search(r"VmRSS:\s+(\d+)", status)
        total, count = total + (int(rss.group(1)) if rss else 0), count + 1
    return count, total / 1024


def available_mb() -> int:
    """The host's MemAvailable."""
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"MemAvailable:\s+(\d+)", text).group(1)) // 1024
