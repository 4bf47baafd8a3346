"""The names of the failure classes: one table that both wings read.

The job writes ``HANG`` and ``NON_FINITE`` into its failure records (``DIAGNOSED``); the
launcher's ``records/failures.py`` owns what each class means and what is done about it.
"""

from __future__ import annotations

COMPLETED = "completed"
RUNNING = "running"
TIMEOUT = "timeout"
PREEMPTED = "preempted"
CANCELLED = "cancelled"
RANK_KILLED = "rank_killed"
NODE_FAILURE = "node_failure"
COLLECTIVE_FAILURE = "collective_failure"
HANG = "hang"
HOST_OOM = "host_oom"
GPU_OOM = "gpu_oom"
CODE_ERROR = "code_error"
NON_FINITE = "non_finite"
STORAGE_FULL = "storage_full"
STORAGE_ERROR = "storage_error"
UNKNOWN = "unknown"

# the classes a rank diagnoses itself and writes into its failure record (``failure_class``)
DIAGNOSED = (HANG, NON_FINITE)
