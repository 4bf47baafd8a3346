"""This computer's memory and cores, as ``machine=local`` needs them (no torch, no Hydra).

The login node compares the ranks' estimated memory with what is available here
(``available``); a rank's supervisor asks whether the kernel's OOM killer killed a rank
(``OomWatch``). Both read the memory cgroup of a process: cgroup v1's ``memory``
hierarchy (``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``memory.oom_control``'s
``oom_kill`` counter), else cgroup v2's unified one (``memory.max``, ``memory.current``,
``memory.events``' ``oom_kill``). The kernel counts an OOM kill in the victim's memory
cgroup whether its own limit or the whole computer ran out (mm/oom_kill.c,
``memcg_memory_event_mm(mm, MEMCG_OOM_KILL)``), so a rise of the counter over a rank's
life, with the rank dead of SIGKILL, is the OOM killer's mark; the kernel log
(``/dev/kmsg``: ``Killed process <pid> (...)``) names the pid too where it is readable.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024**3
UNLIMITED = 1 << 60  # v1 writes 2**63 rounded down to a page for "no limit"
KMSG = "/dev/kmsg"
KILLED_PROCESS = re.compile(r"Killed process (?P<pid>\d+) \(")
KERNEL_CLOCK_SLACK_S = 5.0  # the log's clock and CLOCK_MONOTONIC may differ a little
OOM_COUNT_WAIT_S = 0.2  # the kernel counts the kill just after sending SIGKILL


class HostOutOfMemory(Exception):
    """What a failure record calls a rank the kernel's OOM killer killed (the supervisor
    writes it: the rank could not)."""


@dataclass(frozen=True)
class Room:
    """Memory a new job may use here: ``bytes``, and ``source``, in words (MemAvailable, or
    the memory cgroup whose limit leaves less)."""

    bytes: int
    source: str


def cores() -> int:
    """The cores this process may run on (its affinity: a cpuset or ``taskset`` counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def mem_available() -> int | None:
    """/proc/meminfo's MemAvailable in bytes (None where there is none)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    return int(found[1]) * 1024 if found else None


def available(pid: int | str = "self") -> Room | None:
    """What a job started by ``pid`` may use: MemAvailable, or less where a memory cgroup
    limit of it or of a parent leaves less (a container's); None where neither is known."""
    rooms = []
    total = mem_available()
    if total is not None:
        rooms.append(Room(total, "MemAvailable"))
    group = memory_cgroup(pid)
    if group is not None:
        rooms += cgroup_rooms(group)
    return min(rooms, key=lambda room: room.bytes, default=None)


def cgroup_rooms(group: Path) -> list[Room]:
    """The room each limited memory cgroup from ``group`` up to its hierarchy's root leaves:
    its limit less what it holds, page cache that can be dropped (inactive files) aside."""
    rooms = []
    for level in [group, *group.parents]:
        if not (level / "cgroup.procs").exists():
            break
        limit = _limit(level)
        if limit is None or limit >= UNLIMITED:
            continue
        held = max(0, _usage(level) - _stat(level, "total_inactive_file", "inactive_file"))
        words = f"memory cgroup {level} (limit {limit / GIB:.1f} GiB)"
        rooms.append(Room(max(0, limit - held), words))
    return rooms


def memory_cgroup(pid: int | str = "self") -> Path | None:
    """The directory of ``pid``'s memory cgroup (v1's memory hierarchy, else v2's), or None."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    mounts = cgroup_mounts()
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(",") and "memory" in mounts:
            found = mounts["memory"] / path.lstrip("/")
            return found if found.is_dir() else None
    for line in lines:
        if line.startswith("0::") and "unified" in mounts:
            found = mounts["unified"] / line[3:].lstrip("/")
            has_memory = (found / "memory.events").exists() or (found / "memory.max").exists()
            return found if has_memory else None
    return None


def cgroup_mounts() -> dict[str, Path]:
    """Where the v1 memory hierarchy (``memory``) and the v2 one (``unified``) are mounted."""
    mounts: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return mounts
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup" and "memory" in tail[2].split(","):
            mounts.setdefault("memory", Path(fields[4]))
        elif tail[0] == "cgroup2":
            mounts.setdefault("unified", Path(fields[4]))
    return mounts


def oom_kills(group: Path | None) -> int | None:
    """The kernel's count of processes of ``group`` its OOM killer killed (v1:
    memory.oom_control, v2: memory.events), or None where it keeps none."""
    if group is None:
        return None
    for name in ("memory.oom_control", "memory.events"):
        found = re.search(r"^oom_kill (\d+)$", _read(group / name), re.M)
        if found:
            return int(found[1])
    return None


def kernel_oom_line(pid: int, since_s: float = 0.0) -> str:
    """The kernel log's line saying its OOM killer killed ``pid`` (logged after ``since_s``,
    CLOCK_MONOTONIC seconds), or "" when none says so or the log is not readable here."""
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    found = ""
    try:
        while True:
            try:
                entry = os.read(fd, 16384).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: older entries were overwritten while read; go on
                continue
            if not entry:
                break
            header, _, message = entry.partition(";")
            killed = KILLED_PROCESS.search(message)
            if killed and int(killed["pid"]) == pid and _logged_after(header, since_s):
                found = message.splitlines()[0].strip()
    finally:
        os.close(fd)
    return found


@dataclass
class OomWatch:
    """The OOM killer's count in the memory cgroup the ranks start in, taken before they
    start; ``evidence(pid)`` then says whether it killed a rank that died of SIGKILL."""

    group: Path | None = None
    kills: int | None = None
    started_s: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls) -> OomWatch:
        """Taken by the supervisor, whose cgroup its ranks inherit."""
        group = memory_cgroup()
        return cls(group, oom_kills(group))

    def evidence(self, pid: int) -> dict:
        """What shows that the OOM killer killed ``pid``: ``oom_kill`` (the cgroup's count
        before and after) with ``cgroup`` and its ``limit_bytes``, and ``kernel_log`` (the
        kernel's line naming the pid); {} when nothing does."""
        found: dict = {}
        after = self._count_after()
        if self.kills is not None and after is not None and after > self.kills:
            found = {"cgroup": str(self.group), "oom_kill": [self.kills, after]}
            limit = _limit(self.group) if self.group else None
            if limit is not None and limit < UNLIMITED:
                found["limit_bytes"] = limit
        line = kernel_oom_line(pid, self.started_s - KERNEL_CLOCK_SLACK_S)
        return found | {"kernel_log": line} if line else found

    def _count_after(self) -> int | None:
        deadline = time.monotonic() + OOM_COUNT_WAIT_S
        while True:
            count = oom_kills(self.group)
            if count is None or self.kills is None or count > self.kills:
                return count
            if time.monotonic() >= deadline:
                return count
            time.sleep(0.05)


def describe_evidence(rank: int, pid: int, evidence: dict) -> str:
    """``rank 1 (pid 42) was killed by the kernel's OOM killer (memory cgroup ...: oom_kill
    0 -> 1, limit 0.5 GiB)``: one line for the failure record and the console."""
    said = []
    if "oom_kill" in evidence:
        before, after = evidence["oom_kill"]
        limit = evidence.get("limit_bytes")
        words = f"memory cgroup {evidence['cgroup']}: oom_kill {before} -> {after}"
        said.append(words + (f", limit {limit / GIB:.2f} GiB" if limit else ""))
    if evidence.get("kernel_log"):
        said.append(f"kernel log: {short_kernel_line(evidence['kernel_log'])}")
    return f"rank {rank} (pid {pid}) was killed by the kernel's OOM killer ({'; '.join(said)})"


def short_kernel_line(line: str) -> str:
    """The kernel's kill line up to the process's name, and its anonymous memory:
    ``Memory cgroup out of memory: Killed process 42 (axonn-rank-1), anon-rss:1993084kB``."""
    head = re.match(r".*?Killed process \d+ \([^)]*\)", line)
    rss = re.search(r"anon-rss:\d+kB", line)
    return (head[0] if head else line) + (f", {rss[0]}" if head and rss else "")


def _logged_after(header: str, since_s: float) -> bool:
    parts = header.split(",")
    try:
        return len(parts) < 3 or int(parts[2]) / 1e6 >= since_s
    except ValueError:
        return True


def _limit(group: Path) -> int | None:
    text = (_read(group / "memory.limit_in_bytes") or _read(group / "memory.max")).strip()
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None


def _usage(group: Path) -> int:
    text = (_read(group / "memory.usage_in_bytes") or _read(group / "memory.current")).strip()
    return int(text) if text.isdigit() else 0


def _stat(group: Path, *names: str) -> int:
    text = _read(group / "memory.stat")
    for name in names:
        found = re.search(rf"^{name} (\d+)$", text, re.M)
        if found:
            return int(found[1])
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
