"""Why a job ended, and what to do about it: pure functions on sacct fields and log text.

``classify(evidence)`` reads, in this order of trust: the Slurm state (sacct, or squeue
while the job is queued), the outcome in submitit's result pickles, and signatures in
the tail of the task logs. Each class maps to one action:

==================  ===============================================================
class               action
==================  ===============================================================
completed           none: the job finished
running             wait: queued, running or being requeued
timeout             resume from the latest checkpoint
preempted           resume from the latest checkpoint
cancelled           resume from the latest checkpoint (``resubmit`` is the request)
rank_killed         resume: a rank, srun or slurmstepd died from a signal (kill -9,
                    segfault) with no error in any log and no sign of memory
                    exhaustion; also a job sacct calls COMPLETED whose tasks did
                    not all return (their step was lost)
node_failure        resume, excluding the failed nodes (``--exclude``)
collective_failure  resume, excluding the nodes whose ranks reported the error
host_oom            do not retry unchanged; retry only with a new grid or node count
gpu_oom             do not retry unchanged; retry only with a new grid or node count
code_error          do not retry: a Python exception or a configuration error
storage_full        stop: the job dir's file system is full or over quota (ENOSPC,
                    EDQUOT); free space, then relaunch. No node is to blame
storage_error       stop: another I/O error on a file (EIO, EROFS, ESTALE); fix the
                    file system, then relaunch. No node is to blame
unknown             report: nothing recognizable; read the logs
==================  ===============================================================

Storage faults come first among the log signatures: a full disk fails a checkpoint
write on one rank, and its peers then report lost connections and aborted collectives,
which would otherwise blame (and exclude) healthy nodes.
"""

from __future__ import annotations

import errno
import functools
import re
from dataclasses import dataclass, field

# The Slurm text rules live in slurmtext; records/status.py and the tests read these
# names from here.
from axonn_launch.common.slurmtext import ACTIVE_STATES, base_state
from axonn_launch.common.slurmtext import expand_nodelist as expand_nodelist

COMPLETED = "completed"
RUNNING = "running"
TIMEOUT = "timeout"
PREEMPTED = "preempted"
CANCELLED = "cancelled"
RANK_KILLED = "rank_killed"
NODE_FAILURE = "node_failure"
COLLECTIVE_FAILURE = "collective_failure"
HOST_OOM = "host_oom"
GPU_OOM = "gpu_oom"
CODE_ERROR = "code_error"
STORAGE_FULL = "storage_full"
STORAGE_ERROR = "storage_error"
UNKNOWN = "unknown"

RESUME = "resume"
RESUME_EXCLUDING = "resume_excluding_nodes"
RETRY_WITH_NEW_GRID = "retry_only_with_new_grid"
DO_NOT_RETRY = "do_not_retry"
WAIT = "wait"
NONE = "none"
REPORT = "report"
STOP = "stop"

ACTIONS = {
    COMPLETED: NONE,
    RUNNING: WAIT,
    TIMEOUT: RESUME,
    PREEMPTED: RESUME,
    CANCELLED: RESUME,
    RANK_KILLED: RESUME,
    NODE_FAILURE: RESUME_EXCLUDING,
    COLLECTIVE_FAILURE: RESUME_EXCLUDING,
    HOST_OOM: RETRY_WITH_NEW_GRID,
    GPU_OOM: RETRY_WITH_NEW_GRID,
    CODE_ERROR: DO_NOT_RETRY,
    STORAGE_FULL: STOP,
    STORAGE_ERROR: STOP,
    UNKNOWN: REPORT,
}
CLASSES = tuple(ACTIONS)
STORAGE_CLASSES = (STORAGE_FULL, STORAGE_ERROR)

STATE_CLASSES = {
    "TIMEOUT": TIMEOUT,
    "DEADLINE": TIMEOUT,
    "PREEMPTED": PREEMPTED,
    "NODE_FAIL": NODE_FAILURE,
    "BOOT_FAIL": NODE_FAILURE,
    "OUT_OF_MEMORY": HOST_OOM,
    "CANCELLED": CANCELLED,
}

# The kernel's words for a full file system (strerror, errno and name), as an OSError,
# DCP's CheckpointException or a C library message print them.
STORAGE_FULL_PATTERNS = (
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
STORAGE_ERROR_PATTERNS = (
    r"Read-only file system",
    r"\[Errno 30\]",
    r"\bEROFS\b",
    r"Stale (?:NFS )?file handle",
    r"\[Errno 116\]",
    r"\bESTALE\b",
    r"\[Errno 5\] Input/output error: '",
)
STORAGE_ERRNOS = {
    errno.ENOSPC: STORAGE_FULL,
    errno.EDQUOT: STORAGE_FULL,
    errno.EIO: STORAGE_ERROR,
    errno.EROFS: STORAGE_ERROR,
    errno.ESTALE: STORAGE_ERROR,
}
# Log signatures, most specific first. Each is searched case-sensitively in the log tails.
GPU_OOM_PATTERNS = (
    r"CUDA out of memory",
    r"HIP out of memory",
    r"torch\.(?:cuda\.)?OutOfMemoryError",
    r"CUDA error: out of memory",
    r"HIP error: out of memory",
    r"hipErrorOutOfMemory",
    r"cudaErrorMemoryAllocation",
    r"CUBLAS_STATUS_ALLOC_FAILED",
    r"NCCL WARN .*(?:Cuda|Hip) failure 'out of memory'",
)
HOST_OOM_PATTERNS = (
    r"oom[-_]kill(?:ed)? event",
    r"Out Of Memory",
    r"oom-kill",
    r"Killed process \d+ .*out of memory",
    r"^MemoryError\b",
    r"\bMemoryError: ",
)
PRIMARY_COLLECTIVE_PATTERNS = (
    r"NCCL error",
    r"RCCL error",
    r"nccl(?:InternalError|SystemError|UnhandledCudaError|RemoteError|InvalidUsage)",
    r"Watchdog caught collective operation timeout",
    r"ProcessGroup(?:NCCL|Gloo)\S* .*(?:timeout|timed out|aborted)",
    r"NCCL communicator was aborted",
    r"DistBackendError",
    r"[Gg]loo error",
    r"Timed out waiting \d+ms for recv operation",
)
# what the peers of a dead rank report
PEER_LOST_PATTERNS = (
    r"Connection (?:closed|reset) by peer",
    r"gloo/transport/tcp/pair\.cc",
    r"Broken pipe",
)
NODE_FAILURE_PATTERNS = (
    r"[Nn]ode failure on (?P<node>[\w.-]+)",
    r"NODE_FAIL",
    r"slurmstepd: error: .*(?:node|Node) (?P<node>[\w.-]+) (?:failed|not responding)",
)
TIMEOUT_PATTERNS = (
    r"DUE TO TIME LIMIT",
    r"Job not requeued because: timed-out",
)
PREEMPT_PATTERNS = (r"DUE TO PREEMPTION",)
# scancel of the whole job (a step-only banner also follows a rank's crash)
CANCEL_PATTERNS = (r"\*\*\* JOB \w+ ON \S+ CANCELLED AT \S+ \*\*\*",)
KILLED_TASK = re.compile(
    r"srun: error: (?P<node>[\w.-]+): tasks? (?P<tasks>[\d,-]+): "
    r"(?P<reason>Killed|Segmentation fault|Aborted|Bus error)"
)
# srun or slurmstepd killed: the batch shell reports srun's death; srun reports a step
# whose slurmstepd vanished
KILLED_LAUNCHER_PATTERNS = (
    r"\d+ Killed\s+srun ",
    r"srun: error: Aborting, io error and missing step",
)
# the step-only banner: after a rank's crash, and alone when srun was killed
STEP_CANCELLED = r"\*\*\* STEP [\w.]+ ON \S+ CANCELLED AT \S+ \*\*\*"
# torch.distributed prefixes a rank's uncaught traceback lines with "[rankN]: "
PYTHON_EXCEPTION = re.compile(
    r"^(?:\[rank\d+\]: ?)?(?P<name>[A-Za-z_][\w.]*(?:Error|Exception|Exit)): ", re.M
)
TRACEBACK = "Traceback (most recent call last)"
SUBMITIT_UNCOMPLETED = "UncompletedJobError"


@dataclass(frozen=True)
class Evidence:
    """What is known about one job (every field may be empty).

    ``state``: the sacct/squeue state, e.g. ``CANCELLED by 0``; ``exit_code``: sacct's
    ``rc:signal``; ``results``: submitit result-pickle outcomes (``("success", value)`` or
    ``("error", traceback)``) of the tasks that wrote one; ``expected_results``: tasks in
    the job; ``logs``: task index -> tail of that task's stdout+stderr; ``nodes``: the
    job's nodes in task-block order (task t runs on ``nodes[t // tasks_per_node]``);
    ``records``: the ranks' failure records and the launcher's own error (job.json), as
    text, read for storage faults only (a full disk may leave no log line at all).
    """

    state: str = ""
    exit_code: str = ""
    results: tuple[tuple[str, str], ...] = ()
    expected_results: int = 0
    logs: dict[int, str] = field(default_factory=dict)
    nodes: tuple[str, ...] = ()
    tasks_per_node: int = 1
    records: tuple[str, ...] = ()


@dataclass(frozen=True)
class Diagnosis:
    failure: str  # one of CLASSES
    reason: str = ""  # the line or state that decided it
    bad_nodes: tuple[str, ...] = ()  # nodes to exclude on a resubmission

    @property
    def action(self) -> str:
        return ACTIONS[self.failure]


def classify(ev: Evidence) -> Diagnosis:
    """The failure class of one job; see the module docstring for the actions.

    A state that Slurm decided (time limit, preemption, node failure, out of memory,
    cancellation) is trusted as it is; a plain FAILED, or no state at all, is explained
    from the result pickles and the logs.
    """
    state = base_state(ev.state)
    if state in ACTIVE_STATES:
        return Diagnosis(RUNNING, ev.state)
    if state == "COMPLETED" and not _some_task_missing(ev):  # srun exited 0, so every task did
        return Diagnosis(COMPLETED, ev.state)
    if _all_succeeded(ev) and state in ("", "COMPLETED", "UNKNOWN"):
        return Diagnosis(COMPLETED, ev.state or "all tasks returned")
    if state in ("NODE_FAIL", "BOOT_FAIL"):
        return Diagnosis(NODE_FAILURE, ev.state, _failed_nodes(ev) or ev.nodes)
    if state in STATE_CLASSES:
        return Diagnosis(STATE_CLASSES[state], ev.state)
    by_log = classify_storage("\n".join(ev.records)) or classify_text("\n".join(_texts(ev)))
    if by_log is not None:
        return _with_nodes(by_log, ev)
    if _killed_by_signal(ev.exit_code):
        return Diagnosis(RANK_KILLED, f"exit code {ev.exit_code}")
    if state == "COMPLETED":
        returned = len(ev.results)
        return Diagnosis(
            RANK_KILLED,
            f"sacct says COMPLETED but {returned} of {ev.expected_results} tasks returned",
        )
    return Diagnosis(UNKNOWN, ev.state or "no state, no result, no recognizable log line")


def classify_text(text: str) -> Diagnosis | None:
    """The class that log/traceback text alone shows, or None.

    Root causes come before their symptoms: when one rank dies, its peers report lost
    connections, so a peer's closed connection counts only when nothing else explains it.
    A storage fault explains everything else.
    """
    storage = classify_storage(text)
    if storage is not None:
        return storage
    checks = (
        (GPU_OOM, GPU_OOM_PATTERNS),
        (NODE_FAILURE, NODE_FAILURE_PATTERNS),
        (HOST_OOM, HOST_OOM_PATTERNS),
        (TIMEOUT, TIMEOUT_PATTERNS),
        (PREEMPTED, PREEMPT_PATTERNS),
        (COLLECTIVE_FAILURE, PRIMARY_COLLECTIVE_PATTERNS),
        (CANCELLED, CANCEL_PATTERNS),
        (RANK_KILLED, (KILLED_TASK.pattern, *KILLED_LAUNCHER_PATTERNS)),
    )
    for failure, patterns in checks:
        line = first_match(text, patterns)
        if line is not None:
            return Diagnosis(failure, line)
    exception = first_code_exception(text)
    if exception is not None:
        return Diagnosis(CODE_ERROR, exception)
    line = first_match(text, PEER_LOST_PATTERNS)
    if line is not None:
        return Diagnosis(COLLECTIVE_FAILURE, line)
    line = first_match(text, (STEP_CANCELLED,))  # stopped, and no rank says why: a kill
    return Diagnosis(RANK_KILLED, line) if line is not None else None


def classify_storage(text: str) -> Diagnosis | None:
    """storage_full or storage_error when ``text`` holds the kernel's words for one."""
    for failure, patterns in (
        (STORAGE_FULL, STORAGE_FULL_PATTERNS),
        (STORAGE_ERROR, STORAGE_ERROR_PATTERNS),
    ):
        line = first_match(text, patterns)
        if line is not None:
            return Diagnosis(failure, line)
    return None


def storage_failure(error: OSError) -> str | None:
    """storage_full or storage_error for an OSError of a file write, else None."""
    return STORAGE_ERRNOS.get(error.errno or 0)


def first_code_exception(text: str) -> str | None:
    """The first ``SomethingError: ...`` line that is not a lost peer or submitit's own."""
    for found in PYTHON_EXCEPTION.finditer(text):
        line = _line_at(text, found.start())
        if SUBMITIT_UNCOMPLETED in found.group("name"):
            continue
        if first_match(line, PEER_LOST_PATTERNS + PRIMARY_COLLECTIVE_PATTERNS) is None:
            return line
    return None


def first_match(text: str, patterns: tuple[str, ...]) -> str | None:
    """The line of ``text`` holding the earliest match of any of ``patterns``, or None."""
    found = _union(patterns).search(text)
    return _line_at(text, found.start()) if found else None


@functools.lru_cache(maxsize=64)
def _union(patterns: tuple[str, ...]) -> re.Pattern:
    """One compiled alternation (named groups made anonymous so names may repeat)."""
    anonymous = (re.sub(r"\(\?P<\w+>", "(?:", p) for p in patterns)
    return re.compile("|".join(f"(?:{p})" for p in anonymous), flags=re.M)


def nodes_of_tasks(
    tasks: list[int], nodes: tuple[str, ...], tasks_per_node: int
) -> tuple[str, ...]:
    """Nodes running ``tasks`` under Slurm's default block distribution."""
    picked = {nodes[t // tasks_per_node] for t in tasks if t // tasks_per_node < len(nodes)}
    return tuple(n for n in nodes if n in picked)


def _some_task_missing(ev: Evidence) -> bool:
    """Evidence that was read (``expected_results``) shows a task without a result."""
    return bool(ev.expected_results) and len(ev.results) < ev.expected_results


def _all_succeeded(ev: Evidence) -> bool:
    if not ev.results or (ev.expected_results and len(ev.results) < ev.expected_results):
        return False
    return all(outcome == "success" for outcome, _ in ev.results)


def _texts(ev: Evidence) -> list[str]:
    errors = [str(value) for outcome, value in ev.results if outcome == "error"]
    return errors + [ev.logs[t] for t in sorted(ev.logs)]


def _with_nodes(diagnosis: Diagnosis, ev: Evidence) -> Diagnosis:
    """Attach the nodes to exclude for the classes whose action excludes nodes."""
    if diagnosis.action != RESUME_EXCLUDING:
        return diagnosis
    if diagnosis.failure == NODE_FAILURE:
        return Diagnosis(diagnosis.failure, diagnosis.reason, _failed_nodes(ev) or ev.nodes)
    tasks = [t for t, text in ev.logs.items() if _primary_collective_error(text)]
    nodes = nodes_of_tasks(tasks, ev.nodes, max(ev.tasks_per_node, 1))
    return Diagnosis(diagnosis.failure, diagnosis.reason, nodes)


def _primary_collective_error(text: str) -> bool:
    """A rank that saw the error itself, not only a peer's closed connection."""
    return first_match(text, PRIMARY_COLLECTIVE_PATTERNS) is not None


def _failed_nodes(ev: Evidence) -> tuple[str, ...]:
    found = []
    for text in _texts(ev):
        for pattern in NODE_FAILURE_PATTERNS:
            for match in re.finditer(pattern, text, flags=re.M):
                node = match.groupdict().get("node")
                if node and node not in found:
                    found.append(node)
    return tuple(found)


def _killed_by_signal(exit_code: str) -> bool:
    """sacct's ``rc:signal``: a signal, or rc 128+n from a shell or srun."""
    rc, _, sig = (exit_code or "").partition(":")
    return (sig.isdigit() and int(sig) > 0) or (rc.isdigit() and int(rc) > 128)


def _line_at(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start : end if end >= 0 else len(text)].strip()
