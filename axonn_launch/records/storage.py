"""Storage faults: which file system (its mount point and type), how much room is free and
how much the next checkpoint needs, the kernel's words; and whether the job dir can take a
new file at all (a file system turned read-only leaves no other evidence).

Login-node code: never imports torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path

from axonn_launch.common.jobdir import JobPaths, checkpoint_bytes, latest_step_name
from axonn_launch.records import failures
from axonn_launch.records.failures import Diagnosis

# the kernel's words in a matched line: an OSError's, else an errno's name
ERRNO_WORDS = (
    re.compile(r"\[Errno \d+\][^\n]*"),
    re.compile(r"\b(?:ENOSPC|EDQUOT|EIO|EROFS|ESTALE)\b[^\n]*"),
)


def storage_reason(job_dir: Path, diagnosis: Diagnosis) -> str:
    """The reason of a storage fault: the job dir's file system (its mount point) and, when
    full, the room the next checkpoint needs (the newest complete one's size) and the room
    free now; then the kernel's words. Nodes are not named: no node is to blame."""
    where = describe_filesystem(job_dir)
    said = errno_words(diagnosis.reason)
    if diagnosis.failure == failures.STORAGE_ERROR:
        return f"I/O error on {where}, the job dir's file system: {said}; fix it, then relaunch"
    over = "over its disk quota" if "quota" in said.lower() or "EDQUOT" in said else "full"
    free = free_bytes(job_dir)
    step = latest_step_name(job_dir)
    need = checkpoint_bytes(JobPaths(job_dir).step(step)) if step else 0
    room = f"{size_text(free)} free now" if free is not None else "free space unknown"
    if need:
        room += f", the next checkpoint needs {size_text(need)} (as {step})"
        if free is not None and free >= need:
            room += ": enough now"
    else:
        room += ", the next checkpoint's size is unknown (no complete checkpoint yet)"
    return f"{where} was {over} ({said}): {room}; free space, then relaunch to resume"


def unwritable_job_dir(job_dir: Path) -> Diagnosis | None:
    """A storage class when no file can be made in the job dir now: a job whose file
    system turned read-only (or full) leaves no log line, no failure record and no final
    job.json, and the file system's refusal is the only evidence. None when a file can be
    made (the probe is removed at once), or the refusal is not the file system's."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=job_dir)
    except OSError as error:
        failure = failures.storage_failure(error)
        said = f"[Errno {error.errno}] {error.strerror}: {job_dir}"
        return Diagnosis(failure, f"a new file in the job dir: {said}") if failure else None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def errno_words(line: str) -> str:
    """The part of ``line`` that names the errno (the whole line without one)."""
    for pattern in ERRNO_WORDS:
        found = pattern.search(line)
        if found:
            return found.group(0).strip()[:160]
    return line.strip()[:160]


def describe_filesystem(path: Path | str) -> str:
    """``<mount point> (<type>)`` of the file system holding ``path``."""
    mount = mount_point(path)
    kind = filesystem_type(mount)
    return f"{mount} ({kind})" if kind else mount


def mount_point(path: Path | str) -> str:
    """The mount point of the file system holding ``path`` (walking up to one)."""
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def filesystem_type(mount: str) -> str:
    """The type /proc/self/mounts gives ``mount`` (the last mount there wins), or ""."""
    kind = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[1].replace("\\040", " ") == mount:
                kind = fields[2]
    return kind


def free_bytes(path: Path | str) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def size_text(size: int | None) -> str:
    if size is None:
        return "?"
    if size >= 1 << 30:
        return f"{size / (1 << 30):.1f} GiB"
    return f"{size / (1 << 20):.1f} MiB"
