"""A process's command line as ``ps`` shows it: shared by the supervisor (login side) and
the zygote (job side), which both start before their job dir is known."""

from __future__ import annotations

import ctypes
from pathlib import Path


def rename_argument(placeholder: str, value: str) -> bool:
    """Write ``value`` over this process's argument ``placeholder``, so that ``ps`` and
    /proc/<pid>/cmdline show it, as ``setproctitle`` does: in the memory that holds the
    arguments the kernel gave the process (Python keeps copies of its own). Linux; False
    when it cannot (no such argument, a longer value)."""
    try:
        cmdline = Path("/proc/self/cmdline").read_bytes()
        arg_start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[45])
    except (OSError, IndexError, ValueError):
        return False
    old, new = placeholder.encode(), value.encode()
    at = cmdline.find(b"\0" + old + b"\0")
    if at < 0 or not arg_start or len(new) > len(old):
        return False
    ctypes.memmove(arg_start + at + 1, new.ljust(len(old), b"\0"), len(old))
    return True
