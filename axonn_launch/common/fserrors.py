"""The errors of a job dir's file system, as the job and the launcher both meet them.

The kernel's words for a full, over-quota, failing, read-only or vanished file system
(the errno, its name, its strerror), and what torch's writers say after a short write,
whose errno is lost. ``records/failures.py`` gives each its failure class
(``storage_full`` or ``storage_error``); the job side uses ``file_system_line`` to end a
rank in one line instead of a traceback (``train/__main__.py``).
"""

from __future__ import annotations

import errno
import re

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
ERROR_ERRNOS = frozenset({errno.EIO, errno.EROFS, errno.ESTALE})

# As an OSError, DCP's CheckpointException or a C library message print them.
FULL_PATTERNS = (
    r"No space left on device",
    r"\[Errno 28\]",
    r"\bENOSPC\b",
    r"Disk quota exceeded",
    r"\[Errno 122\]",
    r"\bEDQUOT\b",
    # torch.save's zip writer after a short write, which is what a full disk gives it
    # (the errno is lost): DCP writes its non-tensor items so
    r"inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+",
    r"PytorchStreamWriter failed writing file .*: file write failed",
)
# Other I/O errors of a file system. EIO counts only with a file name (an OSError's
# ": 'path'"): a bare "Input/output error" is also what a write to a closed terminal gets.
ERROR_PATTERNS = (
    r"Read-only file system",
    r"\[Errno 30\]",
    r"\bEROFS\b",
    r"Stale (?:NFS )?file handle",
    r"\[Errno 116\]",
    r"\bESTALE\b",
    r"\[Errno 5\] Input/output error: '",
)
_ANY = re.compile("|".join(FULL_PATTERNS + ERROR_PATTERNS))


def file_system_line(error: BaseException | None) -> str | None:
    """One line saying how the file system failed ``error`` (an OSError with one of these
    errnos among its causes or DCP's per-rank failures, else the first line of its text
    that holds one of the patterns), or None for any other error."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in FULL_ERRNOS | ERROR_ERRNOS:
            return f"{type(error).__name__}: {error}"
        for failed in (getattr(error, "failures", None) or {}).values():  # DCP's, per rank
            found = file_system_line(failed[0] if isinstance(failed, tuple) else failed)
            if found is not None:
                return found
        said = next((ln.strip() for ln in str(error).splitlines() if _ANY.search(ln)), None)
        if said:
            return said
        error = error.__cause__ or error.__context__
    return None
