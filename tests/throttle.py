"""A real slow rank: a CPU cgroup with a quota, made for one test and removed after it.

The operating system throttles the process (all of its threads), as a busy core, a
throttled node or a noisy neighbour would; nothing in the process knows. cgroup v1's
``cpu`` hierarchy (``cpu.cfs_quota_us``) or a cgroup v2 root that delegates ``cpu``
(``cpu.max``). Skips without root or either hierarchy.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# 20 ms: a 5 % quota is 1 ms (the least the kernel takes) in every 20 ms, so that no step's
# work fits in one burst of the quota (at 100 ms, 5 ms bursts let a step run at full speed)
PERIOD_US = 20_000


def _cpu_root() -> tuple[Path, str] | None:
    """The folder to make the group in and the hierarchy's version."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, "v1"
    v2 = Path("/sys/fs/cgroup")
    controls = v2 / "cgroup.subtree_control"
    if controls.exists() and "cpu" in controls.read_text().split():
        return v2, "v2"
    return None


@contextmanager
def cpu_quota(percent: int) -> Iterator[Callable[[int], None]]:
    """A new CPU cgroup limited to ``percent`` % of one core; yields ``throttle(pid)``,
    which moves that process into it. On leaving, its processes go back to the root and
    the group is removed."""
    if os.geteuid() != 0:
        pytest.skip("making a CPU cgroup needs root")
    found = _cpu_root()
    if found is None:
        pytest.skip("no cgroup v1 cpu hierarchy, nor a v2 root that delegates cpu")
    root, version = found
    group = root / f"axonn-test-throttle-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        quota = PERIOD_US * percent // 100
        if version == "v1":
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    except OSError as exc:
        pytest.skip(f"cannot make a CPU cgroup in {root}: {exc}")
    try:
        yield lambda pid: (group / "cgroup.procs").write_text(str(pid))
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # ended meanwhile
                (root / "cgroup.procs").write_text(pid)
        group.rmdir()
