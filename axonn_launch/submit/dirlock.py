"""One job at a time in a job dir: an exclusive ``flock`` on its lock file (common/jobdir.py's
``JOB_LOCK``). The launcher takes it before it writes anything in the dir (``claim``); a
local job's supervisor takes it over once the launcher lets go (``hold``), and keeps it
until it ends, its recovery step included. The file names its holder (pid and host, then
the job id), so that a refused launch can say whose the dir is.

A Slurm job outlives its launcher and holds no lock: its id, written in the file
(``recorded_job_id``) and in job.json, is checked against squeue (``submit/dirguard.py``).

Torch-free and light: the supervisor imports it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from axonn_launch.common.jobdir import JobPaths

HOLD_WAIT_S = 30.0  # the supervisor's wait for its launcher to let go (it does at once)
HOLD_POLL_S = 0.05


def here() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def local_holder(job_id: str) -> str:
    """How a local job is named as the holder of its dir: ``local-<pid>`` is its supervisor,
    which runs on this host."""
    return f"local job {job_id} (pid {job_id.removeprefix('local-')} on {socket.gethostname()})"


def _open(job_dir: Path, create: bool) -> IO[str] | None:
    """The lock file, open for reading and writing (created when ``create``); None when it
    is missing and not to be created. Other errors (a read-only dir) are raised."""
    path = JobPaths(job_dir).job_lock
    if not create and not path.exists():
        return None
    return open(path, "a+")


def _try_lock(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _write(handle: IO[str], holder: str, job_id: str = "") -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"holder": holder, "job_id": job_id, "since": time.time()}) + "\n")
    handle.flush()


def _read(handle: IO[str]) -> dict:
    handle.seek(0)
    try:
        found = json.loads(handle.read() or "{}")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


class Claim:
    """A launcher's hold on a job dir: the open lock file with the flock on it."""

    def __init__(self, job_dir: Path, handle: IO[str]) -> None:
        self.job_dir = job_dir
        self.handle: IO[str] | None = handle

    def name(self, holder: str, job_id: str = "") -> None:
        """Say who the dir is for now (what a refused launch names): the job, once it has
        an id. Never raises: the lock holds whatever the file says."""
        if self.handle is not None:
            with contextlib.suppress(OSError):
                _write(self.handle, holder, job_id)

    def release(self) -> None:
        """Let go (closing the file drops the flock); the next holder may take it."""
        if self.handle is not None:
            with contextlib.suppress(OSError):
                self.handle.close()
        self.handle = None


def claim(job_dir: Path) -> Claim | None:
    """Take the dir's lock for a launch (the dir is made); None when another process holds
    it. An unwritable dir raises OSError."""
    job_dir.mkdir(parents=True, exist_ok=True)
    handle = _open(job_dir, create=True)
    assert handle is not None
    if not _try_lock(handle):
        handle.close()
        return None
    taken = Claim(job_dir, handle)
    taken.name(f"a launch ({here()})")
    return taken


def held_by(job_dir: Path) -> str | None:
    """Who holds the dir's lock now, in its own words; None when nobody does."""
    try:
        handle = _open(job_dir, create=False)
    except OSError:
        return None
    if handle is None:
        return None
    with handle:
        if _try_lock(handle):
            return None  # closing the file lets go at once
        return str(_read(handle).get("holder") or "another process")


def recorded_job_id(job_dir: Path) -> str:
    """The job id the lock file names ('' without one): a Slurm job holds no flock."""
    try:
        handle = _open(job_dir, create=False)
    except OSError:
        return ""
    if handle is None:
        return ""
    with handle:
        return str(_read(handle).get("job_id") or "")


def hold(job_dir: Path, job_id: str) -> IO[str] | None:
    """A local job's supervisor takes the dir's lock from its launcher (which lets go as it
    releases the supervisor) and keeps the returned file open while it lives; None when
    it could not (said by the caller): the job runs anyway, job.json names it."""
    try:
        handle = _open(job_dir, create=True)
    except OSError:
        return None
    assert handle is not None
    deadline = time.monotonic() + HOLD_WAIT_S
    while not _try_lock(handle):
        if time.monotonic() > deadline:
            handle.close()
            return None
        time.sleep(HOLD_POLL_S)
    with contextlib.suppress(OSError):
        _write(handle, local_holder(job_id), job_id)
    return handle
