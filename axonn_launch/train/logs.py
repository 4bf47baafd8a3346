"""Job-side logging: one line per record, naming the rank and the host.

``setup_logging(rank, job_dir)`` configures the ``axonn_launch`` logger of this rank's
process once: every rank appends to its rank log in the job dir (DEBUG and up), and
rank 0 also writes INFO and up to stdout. Modules log with
``logging.getLogger(__name__)``.

Levels, and where other ranks' output goes: ``docs/job-side.md`` ("train/logs.py").
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from axonn_launch.common.jobdir import JobPaths
from axonn_launch.common.ranks import node_name

LOGGER = "axonn_launch"
FORMAT = "%(asctime)s rank {rank} host {host} %(levelname)s %(name)s: %(message)s"


def rank_log_path(job_dir: str | Path, rank: int) -> Path:
    return JobPaths(job_dir).rank_log(rank)


class RankFileHandler(logging.FileHandler):
    """The rank's file; a write that fails (a full disk) is said once in one line on stderr,
    not as logging's traceback after every record (rank 0's stderr is the console)."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        if not self.failed:
            self.failed = True
            print(f"logging: cannot write {self.baseFilename}: {error}", file=sys.stderr)


def setup_logging(rank: int, job_dir: str | Path) -> logging.Logger:
    """Send this process's ``axonn_launch.*`` records to its rank file (and rank 0's to
    stdout), formatted with rank and host; returns the ``axonn_launch`` logger."""
    logger = logging.getLogger(LOGGER)
    for handler in [h for h in logger.handlers if getattr(h, "axonn_rank_handler", False)]:
        logger.removeHandler(handler)
        handler.close()
    path = rank_log_path(job_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [RankFileHandler(path, mode="a")]
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setLevel(logging.INFO)
        handlers.append(console)
    formatter = logging.Formatter(FORMAT.format(rank=rank, host=node_name()))
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.axonn_rank_handler = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # the files; the console handler keeps INFO and up
    logger.propagate = False  # one line per record, whatever the root logger has
    return logger
