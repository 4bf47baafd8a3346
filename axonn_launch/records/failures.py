"""Why a job ended, and what to do about it: pure functions on sacct fields and log text.

``classify(evidence)`` reads the Slurm state, submitit's result pickles, failure records
and the task logs, in an order of trust, and returns one class. ``RECOVERY`` is the one
table of each class's action: what ``jobs resubmit`` does by hand and, in its ``by_chain``
column, what a self-recovering run's chain does. In short:

completed           none: the job finished
running             wait: queued, running or being requeued
timeout             resume from the latest checkpoint
preempted           resume from the latest checkpoint
cancelled           resume (``resubmit`` is the request); the chain stops
rank_killed         resume: a rank died from a signal with no error in any log
node_failure        resume, excluding the failed nodes (also a GPU's hardware fault)
collective_failure  resume, excluding the nodes that reported it (the chain: same nodes)
hang                resume, excluding the nodes of the ranks that stopped making progress
host_oom            do not retry unchanged; retry only with a new grid or node count
gpu_oom             do not retry unchanged; retry only with a new grid or node count
code_error          do not retry: a Python exception or a configuration error
non_finite          stop: a step's loss or gradients were not finite
storage_full        stop: the job dir's file system is full or over quota
storage_error       stop: another I/O error on a file
unknown             report: nothing recognizable; read the logs

Each class's evidence, and why the evidence is read in this order: ``docs/recovery.md``
("records/failures.py").
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

# The Slurm text rules live in slurmtext; scheduler/slurm_queries, records/ (evidence, status) and
# the tests read these names from here.
from axonn_launch.common import failure_classes, fserrors

# The class names live in common/ (the job reads them too); this module owns their actions.
from axonn_launch.common.failure_classes import (
    CANCELLED,
    CODE_ERROR,
    COLLECTIVE_FAILURE,
    COMPLETED,
    GPU_OOM,
    HANG,
    HOST_OOM,
    NODE_FAILURE,
    NON_FINITE,
    PREEMPTED,
    RANK_KILLED,
    RUNNING,
    STORAGE_ERROR,
    STORAGE_FULL,
    TIMEOUT,
    UNKNOWN,
)
from axonn_launch.common.slurmtext import ACTIVE_STATES, base_state
from axonn_launch.common.slurmtext import expand_nodelist as expand_nodelist

# The one vocabulary of actions: ``jobs status`` says them, ``jobs resubmit`` and the chain
# (submit/chain.py, whose ``recovery.policy`` values are RESUME, RESUME_EXCLUDING, STOP and
# ROLLBACK) do them.
NONE = "none"  # the job finished
WAIT = "wait"  # queued, running or being requeued
RESUME = "resume"  # from the latest checkpoint, on the same nodes
RESUME_EXCLUDING = "resume_exclude"  # from the latest checkpoint, without the bad nodes
ROLLBACK = "rollback"  # resume before a non-finite step and skip its batch (once a step)
STOP = "stop"  # nothing more is done
RETRY_WITH_NEW_GRID = "retry_only_with_new_grid"  # stop; retry only with a new grid or nodes
DO_NOT_RETRY = "do_not_retry"  # stop: a bug or a configuration error
REPORT = "report"  # stop: nothing recognizable; read the logs


class Recovery(NamedTuple):
    """What is done about one failure class, by whom."""

    by_hand: str  # what ``jobs resubmit`` does (and ``jobs status`` says) without a chain
    by_chain: str  # the chain's default; ``recovery.policy.<class>`` overrides it


# The one failure-class table: conf/recovery/auto.yaml's policy must equal its by_chain
# column (tests/records/test_recovery_vocabulary.py).
RECOVERY = {
    COMPLETED: Recovery(NONE, NONE),
    RUNNING: Recovery(WAIT, WAIT),
    TIMEOUT: Recovery(RESUME, RESUME),  # the chain: after submitit's requeues ran out
    PREEMPTED: Recovery(RESUME, RESUME),
    CANCELLED: Recovery(RESUME, STOP),  # by hand, resubmitting is the request; in a chain,
    # a person (or jobs stop) ended it
    RANK_KILLED: Recovery(RESUME, RESUME),
    NODE_FAILURE: Recovery(RESUME_EXCLUDING, RESUME_EXCLUDING),
    # the chain resumes on the same nodes (policy resume_exclude leaves the reporters out)
    COLLECTIVE_FAILURE: Recovery(RESUME_EXCLUDING, RESUME),
    HANG: Recovery(RESUME_EXCLUDING, RESUME_EXCLUDING),  # no node named: a plain resume
    HOST_OOM: Recovery(RETRY_WITH_NEW_GRID, STOP),  # a new grid is a person's choice
    GPU_OOM: Recovery(RETRY_WITH_NEW_GRID, STOP),
    CODE_ERROR: Recovery(DO_NOT_RETRY, STOP),  # never loop on a bug
    NON_FINITE: Recovery(STOP, STOP),  # the same batch diverges again; rollback skips it
    STORAGE_FULL: Recovery(STOP, STOP),  # free space first; no node is to blame
    STORAGE_ERROR: Recovery(STOP, STOP),
    UNKNOWN: Recovery(REPORT, STOP),
}
ACTIONS = {failure: recovery.by_hand for failure, recovery in RECOVERY.items()}
# the classes a chain acts on (it does nothing about a completed or a running attempt)
CHAIN_POLICY = {
    failure: recovery.by_chain
    for failure, recovery in RECOVERY.items()
    if failure not in (COMPLETED, RUNNING)
}
CLASSES = tuple(ACTIONS)
STORAGE_CLASSES = (STORAGE_FULL, STORAGE_ERROR)
# the classes a rank diagnoses itself and writes into its failure record (``failure_class``)
DIAGNOSED_CLASSES = failure_classes.DIAGNOSED
# what may go into --exclude (a suspect the watchdog could not place is named "?")
NODE_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")

STATE_CLASSES = {
    "TIMEOUT": TIMEOUT,
    "DEADLINE": TIMEOUT,
    "PREEMPTED": PREEMPTED,
    "NODE_FAIL": NODE_FAILURE,
    "BOOT_FAIL": NODE_FAILURE,
    "OUT_OF_MEMORY": HOST_OOM,
    "CANCELLED": CANCELLED,
}

# The file system's words for being full, and for its other I/O errors: common/fserrors.py
STORAGE_FULL_PATTERNS = fserrors.FULL_PATTERNS
STORAGE_ERROR_PATTERNS = fserrors.ERROR_PATTERNS
STORAGE_ERRNOS = {
    **dict.fromkeys(fserrors.FULL_ERRNOS, STORAGE_FULL),
    **dict.fromkeys(fserrors.ERROR_ERRNOS, STORAGE_ERROR),
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
# A GPU's hardware fault: the node is to be left out (node_failure), whatever the ranks
# then report (a hang, non-finite values, a failed collective). Sources:
# - NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) and
#   its page-retirement guide (docs.nvidia.com/deploy/dynamic-page-retirement/): the
#   driver logs ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.``.
#   Kept: 48 double-bit ECC (DBE), 63 and 64 row remapping / page retirement recorded or
#   failed (the GPU needs a reset or service), 74 NVLink error, 79 fallen off the bus,
#   94 and 95 contained and uncontained ECC errors, 119 and 120 GSP firmware errors (reset
#   the GPU), 140 unrecovered ECC error. Left out: the Xids an application causes itself
#   (13, 31, 43, 45: a bad kernel, an illegal address, a killed process).
# - CUDA runtime API, enum cudaError (docs.nvidia.com/cuda/cuda-runtime-api/
#   group__CUDART__TYPES.html): cudaErrorECCUncorrectable = 214, whose string (what torch
#   prints after "CUDA error: ") is "uncorrectable ECC error encountered";
#   cudaErrorNvlinkUncorrectable = 220, "uncorrectable NVLink error detected during the
#   execution"; the driver API's CUDA_ERROR_ECC_UNCORRECTABLE and
#   CUDA_ERROR_NVLINK_UNCORRECTABLE.
# - HIP runtime API, enum hipError_t (rocm.docs.amd.com/projects/HIP, reference/
#   error_codes): hipErrorECCNotCorrectable = 214, "uncorrectable ECC error encountered"
#   (HIP's wrappers of older releases: "Uncorrectable ECC error detected").
# - Linux amdgpu RAS (drivers/gpu/drm/amd/amdgpu/amdgpu_ras.c): "uncorrectable hardware
#   error(ERREVENT_ATHUB_INTERRUPT) detected!" and "<n> uncorrectable hardware errors
#   detected in <block> block" (n >= 1: the all-clear reads "no uncorrectable ...").
GPU_FAULT_PATTERNS = (
    r"NVRM: Xid \((?:PCI:)?[0-9A-Fa-f:.]+\): (?:48|63|64|74|79|94|95|119|120|140)\b",
    r"GPU has fallen off the bus",
    r"uncorrectable double bit error \(DBE\)",
    r"\b[Uu]ncorrectable ECC error (?:encountered|detected)",
    r"\bcudaErrorECCUncorrectable\b",
    r"\bCUDA_ERROR_ECC_UNCORRECTABLE\b",
    r"\bhipErrorECCNotCorrectable\b",
    r"\bcudaErrorNvlinkUncorrectable\b",
    r"\bCUDA_ERROR_NVLINK_UNCORRECTABLE\b",
    r"uncorrectable NVLink error",
    r"[Uu]ncorrectable hardware error ?\(ERREVENT_\w+\) detected",
    r"\b[1-9]\d* (?:new )?uncorrectable hardware errors detected in (?:total in )?\w+ block",
)
# What a rank's watchdog and non-finite guard print (train/health/watchdog.py, train/loop.py),
# for when their failure records are missing. The watchdog's line:
#   axonn_launch watchdog: hang: rank 1 (n1) saw no progress in section step of step 113
#   for 45 s (deadline 40 s); without progress: rank 2 (n2), silent; stacks in <dir>
HANG_LINE = re.compile(
    r"axonn_launch watchdog: hang: rank (?P<rank>\d+) \((?P<node>[^)]*)\) saw no progress"
    r" in section (?P<section>\S+) of step (?P<step>\d+) for (?P<stalled>[\d.]+) s"
    r"[^\n]*?(?:; without progress: (?P<suspects>[^\n]*?))?(?:; stacks in (?P<stacks>\S+))?$",
    re.M,
)
SUSPECT_WORDS = re.compile(r"rank (?P<rank>\d+) \((?P<node>[^)]*)\)")
# the guard's log line, and the NonFiniteError it raises (not a code error)
NON_FINITE_LINE = re.compile(
    r"(?:axonn_launch: non_finite: |NonFiniteError: )"
    r"non-finite (?P<first>loss|gradients) at step (?P<step>\d+)"
)
# what a rank the OOM killer killed is to change (the supervisor's record, machine=local)
HOST_OOM_FIX = (
    "use fewer ranks, a smaller model, a smaller train.micro_batch or"
    " train.activation_checkpointing=true"
)
OOM_EVIDENCE = ("rank", "pid", "cgroup", "oom_kill", "limit_bytes", "kernel_log")
# a rank's error recorded before its peers' own diagnosis explains it (they waited for it)
CAUSES_BEFORE_A_DIAGNOSIS = (CODE_ERROR, GPU_OOM, HOST_OOM)
TIMEOUT_PATTERNS = (
    r"DUE TO TIME LIMIT",
    r"Job not requeued because: timed-out",
)
PREEMPT_PATTERNS = (r"DUE TO PREEMPTION",)
# scancel of the whole job (a step-only banner also follows a rank's crash)
CANCEL_PATTERNS = (
    r"\*\*\* JOB \w+ ON \S+ CANCELLED AT \S+ \*\*\*",
    # a rank that saved on SIGTERM (submit/task.py): scancel --signal=TERM, or a preemption
    r"axonn_launch: rank \d+: SIGTERM: stopped after step \d+, checkpoint saved",
)
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
# sacct's ExitCode of a job whose --output or --error file Slurm could not open (a directory
# that does not exist, or a path a '%' placeholder turned into one): no rank ever ran, and
# the same script fails the same way again. Not a signal, though it reads as one.
OUTPUT_NOT_OPENED = "0:53"
OUTPUT_NOT_OPENED_REASON = (
    "exit code 0:53: Slurm could not open the job's output or error file (a directory"
    " missing, unwritable, or a '%' in its path read as a placeholder)"
)
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
    text, read for storage faults and GPU hardware faults (a full disk may leave no log
    line at all); ``failure_records``: the same ranks' failure records as written
    (``common/jobdir.record_failure``: ``rank``, ``host``, ``time``, ``exception``,
    ``tail``, and a rank's own diagnosis: ``failure_class`` and its evidence).
    """

    state: str = ""
    exit_code: str = ""
    results: tuple[tuple[str, str], ...] = ()
    expected_results: int = 0
    logs: dict[int, str] = field(default_factory=dict)
    nodes: tuple[str, ...] = ()
    tasks_per_node: int = 1
    records: tuple[str, ...] = ()
    failure_records: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Diagnosis:
    failure: str  # one of CLASSES
    reason: str = ""  # the line or state that decided it
    bad_nodes: tuple[str, ...] = ()  # nodes to exclude on a resubmission
    # what a hang or a non-finite step left as evidence: for a hang ``section``, ``step``,
    # ``stalled_s``, ``suspects`` ([{"rank", "node"}]) and ``stacks``; for a non-finite
    # step ``step`` and ``first`` (``loss`` or ``gradients``); {} for the other classes
    detail: dict = field(default_factory=dict, compare=False)

    @property
    def action(self) -> str:
        return excluding_only_named(ACTIONS[self.failure], self.bad_nodes)

    @property
    def in_own_words(self) -> bool:
        """The reason is the diagnosing record's own (a hang, a non-finite step, a rank the
        OOM killer killed), which ``jobs status`` shows as it is."""
        return self.failure in DIAGNOSED_CLASSES or (self.failure == HOST_OOM and bool(self.detail))


def excluding_only_named(action: str, nodes: Sequence[str]) -> str:
    """A resume that would leave out no node is a plain resume (a hang whose watchdogs
    named no rank, docs/recovery.md)."""
    return RESUME if action == RESUME_EXCLUDING and not nodes else action


def chain_action(failure: str, policy: Mapping[str, str] | None = None) -> str:
    """What a chain does after an attempt of this class: the run's ``recovery.policy``,
    else the table's default; stop for a class it does not act on."""
    return (policy or {}).get(failure) or CHAIN_POLICY.get(failure, STOP)


def lost_from_allocation(lost: tuple[str, ...], state: str, nodelist: str) -> Diagnosis:
    """A job that Slurm resized (RESIZING: a node of a ``--no-kill`` job failed, its batch
    host included) and that then ended, however Slurm calls that end, before its training
    did: a node_failure of the nodes it lost."""
    where = f" on {nodelist}" if nodelist else ""
    return Diagnosis(NODE_FAILURE, f"Slurm resized the job: it lost {', '.join(lost)} from its"
                     f" allocation (RESIZING), then ended {state or '?'}{where} with training"
                     " left", lost)  # fmt: skip


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
    explained = explain(ev)
    if explained is not None:
        return explained
    if ev.exit_code == OUTPUT_NOT_OPENED:
        return Diagnosis(CODE_ERROR, OUTPUT_NOT_OPENED_REASON)
    if _killed_by_signal(ev.exit_code):
        return Diagnosis(RANK_KILLED, f"exit code {ev.exit_code}")
    if state == "COMPLETED":
        returned = len(ev.results)
        return Diagnosis(
            RANK_KILLED,
            f"sacct says COMPLETED but {returned} of {ev.expected_results} tasks returned",
        )
    return Diagnosis(UNKNOWN, ev.state or "no state, no result, no recognizable log line")


def explain(ev: Evidence) -> Diagnosis | None:
    """The class the records and logs of an ended job show, with its nodes, or None: a
    storage fault, a GPU's hardware fault, an OOM kill, a rank's own diagnosis, then the
    logs alone."""
    records, logs = "\n".join(ev.records), "\n".join(_texts(ev))
    found = classify_storage(records) or classify_storage(logs)
    if found is None:
        line = first_match(records + "\n" + logs, GPU_FAULT_PATTERNS)
        found = Diagnosis(NODE_FAILURE, line) if line is not None else None
    if found is None:
        found = oom_killed(ev) or diagnosed(ev)
        if found is not None:
            return found
    found = found or classify_text(logs)
    return _with_nodes(found, ev) if found is not None else None


def diagnosed(ev: Evidence) -> Diagnosis | None:
    """The class that ranks diagnosed themselves (``failure_class`` in their failure
    records: hang, non_finite), or None; an error another rank recorded before it (a code
    error, an out-of-memory) is the cause instead: its peers then waited for it."""
    own = [r for r in ev.failure_records if r.get("failure_class") in DIAGNOSED_CLASSES]
    if not own:
        return None
    first = min(own, key=_record_time)
    cause = _earlier_cause(ev.failure_records, _record_time(first))
    if cause is not None:
        return _with_nodes(cause, ev)
    if first["failure_class"] == NON_FINITE:
        return non_finite_of(first)
    return hang_of([r for r in own if r["failure_class"] == HANG], ev)


def oom_killed(ev: Evidence) -> Diagnosis | None:
    """host_oom from the failure record a local supervisor wrote for a rank that the
    kernel's OOM killer killed (``batch/supervise.record_oom_kill``), or None. It comes
    before the peers' own diagnosis: they stopped because that rank died."""
    killed = [r for r in ev.failure_records if r.get("failure_class") == HOST_OOM]
    if not killed:
        return None
    first = min(killed, key=_record_time)
    detail = {k: first[k] for k in OOM_EVIDENCE if k in first}
    return Diagnosis(HOST_OOM, oom_reason(detail), (), detail)


def oom_reason(detail: dict) -> str:
    """``rank 1 (pid 42) was killed by the kernel's OOM killer: use fewer ranks, ...; seen
    in memory cgroup <dir> (oom_kill 0 -> 1)``: the fix before the evidence, which the
    failure record holds in full."""
    line = f"rank {detail.get('rank')} (pid {detail.get('pid')}) was killed by the kernel's OOM"
    line += f" killer: {HOST_OOM_FIX}"
    if "oom_kill" in detail:
        before, after = detail["oom_kill"]
        where = f"memory cgroup {detail.get('cgroup')}"
        return line + f"; seen in {where} (oom_kill {before} -> {after})"
    return line + "; seen in the kernel log"


def non_finite_of(record: dict) -> Diagnosis:
    """non_finite from the guard's record: ``step`` and ``first`` (loss or gradients)."""
    detail = {k: record[k] for k in ("step", "first") if k in record}
    said = str(record.get("exception", "")).split(": ", 1)[-1]
    reason = said or f"non-finite {detail.get('first', 'values')} at step {detail.get('step')}"
    return Diagnosis(NON_FINITE, reason, (), detail)


def hang_of(records: list[dict], ev: Evidence) -> Diagnosis:
    """hang from the watchdogs' records (the earliest says where; every one's suspects
    count): the suspects' nodes are left out."""
    records = sorted(records, key=_record_time)
    first = records[0]
    suspects = _unique_suspects(s for r in records for s in r.get("suspects") or [])
    detail = {k: first[k] for k in ("section", "step", "stalled_s", "stacks") if k in first}
    said = HANG_LINE.search(str(first.get("exception", "")))  # its node as Slurm names it
    node = said["node"] if said else first.get("host")
    detail |= {"suspects": suspects, "rank": first.get("rank"), "node": node}
    return Diagnosis(HANG, hang_reason(detail), suspect_nodes(suspects, ev), detail)


def suspect_words(suspect: dict) -> str:
    """``rank 2 (n2)``, and where it was when it answered the watchdog (``in compute of
    step 8``); a rank that never answered is only named."""
    words = f"rank {suspect.get('rank')} ({suspect.get('node') or '?'})"
    if suspect.get("section"):
        words += f" in {suspect['section']} of step {suspect.get('step', '?')}"
    return words


def hang_reason(detail: dict) -> str:
    """``section step of step 113 hung: no progress for 45 s; without progress: rank 2
    (n2); stacks in <dir>`` (at most 4 ranks named, then how many more)."""
    names = [suspect_words(s) for s in detail.get("suspects", [])]
    if len(names) > 4:
        names = names[:4] + [f"{len(names) - 4} more"]
    stalled = detail.get("stalled_s")
    line = f"section {detail.get('section', '?')} of step {detail.get('step', '?')} hung"
    line += f": no progress for {float(stalled):.0f} s" if stalled is not None else ""
    line += "; without progress: " + (", ".join(names) or "no rank named (all stopped alike)")
    return line + (f"; stacks in {detail['stacks']}" if detail.get("stacks") else "")


def suspect_nodes(suspects: list[dict], ev: Evidence) -> tuple[str, ...]:
    """The nodes of the ranks that stopped, unique and in order: each suspect's own node,
    else its rank's place in the allocation; only nodes of the allocation when known."""
    tasks_per_node = max(ev.tasks_per_node, 1)
    nodes: list[str] = []
    for suspect in suspects:
        node = str(suspect.get("node") or "")
        if not NODE_NAME.fullmatch(node) and isinstance(suspect.get("rank"), int):
            node = "".join(nodes_of_tasks([suspect["rank"]], ev.nodes, tasks_per_node))
        if NODE_NAME.fullmatch(node) and (not ev.nodes or node in ev.nodes):
            nodes.append(node)
    return tuple(dict.fromkeys(nodes))


def _unique_suspects(suspects) -> list[dict]:
    found: dict[object, dict] = {}
    for suspect in suspects:
        if isinstance(suspect, dict):
            found.setdefault(suspect.get("rank"), suspect)
    return list(found.values())


def _earlier_cause(records: tuple[dict, ...], before: float) -> Diagnosis | None:
    """A code error or an out-of-memory that a rank recorded before ``before``."""
    for record in sorted(records, key=_record_time):
        if _record_time(record) >= before or record.get("failure_class"):
            continue
        if str(record.get("exception", "")).startswith(("SystemExit", "KeyboardInterrupt")):
            continue
        text = "\n".join([str(record.get("exception", "")), *map(str, record.get("tail", []))])
        found = classify_text(text)
        if found is not None and found.failure in CAUSES_BEFORE_A_DIAGNOSIS:
            return found
    return None


def _record_time(record: dict) -> float:
    try:
        return float(record.get("time", 0.0))
    except (TypeError, ValueError):
        return 0.0


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
        (NODE_FAILURE, GPU_FAULT_PATTERNS),
        (GPU_OOM, GPU_OOM_PATTERNS),
        (NODE_FAILURE, NODE_FAILURE_PATTERNS),
        (HOST_OOM, HOST_OOM_PATTERNS),
        (NON_FINITE, (NON_FINITE_LINE.pattern,)),
        (HANG, (HANG_LINE.pattern,)),
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
    """Attach the nodes to exclude for the classes whose action excludes nodes (and what a
    hang's or a non-finite step's log line says)."""
    if diagnosis.failure == NON_FINITE:
        return replace(diagnosis, detail=_non_finite_said(diagnosis.reason))
    if ACTIONS[diagnosis.failure] != RESUME_EXCLUDING:
        return diagnosis
    if diagnosis.failure == HANG:
        detail = _hang_said(ev)
        nodes = suspect_nodes(detail.get("suspects", []), ev)
        return Diagnosis(HANG, diagnosis.reason, nodes, detail)
    if diagnosis.failure == NODE_FAILURE and first_match(diagnosis.reason, GPU_FAULT_PATTERNS):
        return replace(diagnosis, bad_nodes=_gpu_fault_nodes(ev))
    if diagnosis.failure == NODE_FAILURE:
        return Diagnosis(diagnosis.failure, diagnosis.reason, _failed_nodes(ev) or ev.nodes)
    tasks = [t for t, text in ev.logs.items() if _primary_collective_error(text)]
    nodes = nodes_of_tasks(tasks, ev.nodes, max(ev.tasks_per_node, 1))
    return Diagnosis(diagnosis.failure, diagnosis.reason, nodes)


def _gpu_fault_nodes(ev: Evidence) -> tuple[str, ...]:
    """The nodes whose tasks logged a GPU's hardware fault (a task's place in the
    allocation), then the hosts of the failure records that hold one."""
    tasks = [t for t, text in ev.logs.items() if first_match(text, GPU_FAULT_PATTERNS)]
    nodes = list(nodes_of_tasks(tasks, ev.nodes, max(ev.tasks_per_node, 1)))
    for record in ev.failure_records:
        text = "\n".join([str(record.get("exception", "")), *map(str, record.get("tail", []))])
        host = str(record.get("host") or "")
        if first_match(text, GPU_FAULT_PATTERNS) and NODE_NAME.fullmatch(host):
            nodes.append(host)
    return tuple(dict.fromkeys(nodes))


def _hang_said(ev: Evidence) -> dict:
    """What the watchdogs' hang lines in the logs say: the first one's rank, node,
    section, step, stall and stacks; every line's suspects."""
    detail: dict = {}
    suspects = []
    for text in _texts(ev):
        for found in HANG_LINE.finditer(text):
            if not detail:
                detail = {"section": found["section"], "step": int(found["step"]),
                          "stalled_s": float(found["stalled"]), "rank": int(found["rank"]),
                          "node": found["node"]}  # fmt: skip
                if found["stacks"]:
                    detail["stacks"] = found["stacks"]
            for named in SUSPECT_WORDS.finditer(found["suspects"] or ""):
                suspects.append({"rank": int(named["rank"]), "node": named["node"]})
    return detail | {"suspects": _unique_suspects(suspects)} if detail else {}


def _non_finite_said(line: str) -> dict:
    found = NON_FINITE_LINE.search(line)
    return {"step": int(found["step"]), "first": found["first"]} if found else {}


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
