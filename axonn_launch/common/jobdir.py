"""The job directory: every file name in it, and every read, write and lock of its records.

The launcher, the job's ranks and the user's tools all meet here (as submitit's ``JobPaths``
serves its executor and the submitted process). No other module spells a file name of the
job directory (``tests/test_house.py``). Torch-free and submitit-free: a local run, the
job and the login tools all import it.

The directory's layout, file by file: ``docs/launch.md`` ("common/jobdir.py").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from axonn_launch.common.ranks import node_name

RECORD = "job.json"
SPEC = "spec.json"
CONFIG = "config.yaml"
CONSOLE_LOG = "axonn_launch.log"
HYDRA = ".hydra"
SUBMITIT = ".submitit"  # submitit's default folder: never a job dir's own
SLURM = "slurm"
SLURM_JOB = "%j"  # Slurm's job-id placeholder: submitit's folder is given as slurm/%j
SLURM_RESULT = "result.pkl"  # slurm/<id>/<id>_<task>_<kind>: the kinds of files
SLURM_STDOUT = "log.out"
SLURM_STDERR = "log.err"
SUBMISSION = "submission.sh"
SITE_SUBMISSION = "site_submission.sh"
RECOVERY_SCRIPT = "recovery.sh"
PACK_SUBMISSION = "pack_submission.pkl"  # a packed point's job, until its pack runs it
# in a sweep dir: its packs (submit/pack.py), each packs/<n>/ with its script, plan and log,
# and packs/pending/<num>.json for each point that waits to be packed
PACKS = "packs"
PACK_PENDING = "pending"
PACK_SCRIPT = "pack.sh"
PACK_PLAN = "plan.json"
PACK_LOG = "pack_%j.log"  # Slurm fills in %j
ARRAY_LOG = "array_%A_%a.log"  # a job array's (sweep.pack=array): Slurm fills in %A, %a
PREFLIGHT = "preflight.json"
PREFLIGHT_EXPECTED = "preflight_expected.json"
METRICS = "metrics.jsonl"
TIMELINE = "timeline.jsonl"  # one attempt's steps and saves, by wall clock
SUMMARY = "summary.json"
MEMORIZATION = "memorization.json"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
STEP_META = "meta.json"
INTERRUPTED_SAVES = ".tmp_step_*"
LOGS = "logs"
FAILURES = "failures"
HEARTBEATS = "heartbeats"
STACKS = "stacks"
STRAGGLERS = "stragglers.json"
SKIPPED_STEPS = "skipped_steps.json"
TENSORBOARD = "tensorboard"  # in the run's root dir: every attempt's events (train/sinks.py)
GOODPUT_LOGGED = "goodput.json"  # in tensorboard/: the goodput it holds (records/curves.py)
TRACKER = "tracker.json"  # in the run's root dir: its W&B run id
WANDB = "wandb"  # in the run's root dir: W&B's own folder (offline runs)
WANDB_OFFLINE_RUNS = "offline-run-*"  # in it: one folder per attempt (wandb's naming)
# what ran (records/provenance.py): the package as submitted (code_snapshot), first on
# every attempt's PYTHONPATH; the checkout's uncommitted changes; the installed distributions
CODE = "code"
CODE_DIFF = "code.diff"
PIP_FREEZE = "pip_freeze.txt"
PROFILE = "profile"  # train.profile.steps's traces (train/health/profile.py)
PROFILE_TRACE = "trace_rank{rank}.json"
PROFILE_MEMORY = "memory_rank{rank}.json"  # train.profile.memory: RSS, PSS (and CUDA peaks)
PROFILE_SNAPSHOT = "memory_rank{rank}{when}.pickle"  # CUDA's snapshot (pytorch.org/memory_viz)
NCCL_LOG = "nccl_rank{rank}.log"
RANK_LOG = "rank_{rank}.log"
RANK_RECORD = "rank_{rank}.json"  # a rank's heartbeat, and its failure record
STACK_DUMP = "rank_{rank}.txt"
EMULATED_HOST = "emulate/host_{rank}.json"  # in logs/: an emulated host task (train/emulate)
HANG_REQUEST = "REQUEST"  # in heartbeats/: a rank that saw a hang asks for stacks
HANG_COLLECTOR = "COLLECTOR"  # in heartbeats/: the one firing rank that reads every heartbeat
HANG_VERDICT = "VERDICT"  # in heartbeats/: its suspects, which the other firing ranks take
RECOVERY_LOG = "recovery_%j.log"  # Slurm fills in %j
RESUBMIT_LOCK = ".resubmit.lock"
RECORD_LOCK = ".record.lock"
# held while a job lives in the dir: by its launcher, then its local supervisor
# (submit/dirlock.py); it names the holder (a Slurm job outlives any process)
JOB_LOCK = ".job.lock"
FAILURE_TAIL_LINES = 8


class JobPaths:
    """The paths of one job directory's files."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    record = property(lambda self: self.folder / RECORD)
    spec = property(lambda self: self.folder / SPEC)
    config = property(lambda self: self.folder / CONFIG)
    console_log = property(lambda self: self.folder / CONSOLE_LOG)
    submission = property(lambda self: self.folder / SUBMISSION)
    site_submission = property(lambda self: self.folder / SITE_SUBMISSION)
    recovery_script = property(lambda self: self.folder / RECOVERY_SCRIPT)
    pack_submission = property(lambda self: self.folder / PACK_SUBMISSION)
    preflight = property(lambda self: self.folder / PREFLIGHT)
    preflight_expected = property(lambda self: self.folder / PREFLIGHT_EXPECTED)
    metrics = property(lambda self: self.folder / METRICS)
    timeline = property(lambda self: self.folder / TIMELINE)
    summary = property(lambda self: self.folder / SUMMARY)
    memorization = property(lambda self: self.folder / MEMORIZATION)
    checkpoints = property(lambda self: self.folder / CHECKPOINTS)
    latest = property(lambda self: self.folder / CHECKPOINTS / LATEST)
    logs = property(lambda self: self.folder / LOGS)
    failures = property(lambda self: self.folder / LOGS / FAILURES)
    heartbeats = property(lambda self: self.folder / LOGS / HEARTBEATS)
    stacks = property(lambda self: self.folder / LOGS / STACKS)
    stragglers = property(lambda self: self.folder / STRAGGLERS)
    skipped_steps = property(lambda self: self.folder / SKIPPED_STEPS)
    tensorboard = property(lambda self: self.folder / TENSORBOARD)
    tracker = property(lambda self: self.folder / TRACKER)
    goodput_logged = property(lambda self: self.folder / TENSORBOARD / GOODPUT_LOGGED)
    wandb = property(lambda self: self.folder / WANDB)
    profile = property(lambda self: self.folder / PROFILE)
    code = property(lambda self: self.folder / CODE)
    code_diff = property(lambda self: self.folder / CODE_DIFF)
    pip_freeze = property(lambda self: self.folder / PIP_FREEZE)
    job_lock = property(lambda self: self.folder / JOB_LOCK)
    recovery_log = property(lambda self: self.logs / RECOVERY_LOG)
    hang_request = property(lambda self: self.heartbeats / HANG_REQUEST)
    hang_collector = property(lambda self: self.heartbeats / HANG_COLLECTOR)
    hang_verdict = property(lambda self: self.heartbeats / HANG_VERDICT)

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / RANK_RECORD.format(rank=rank)

    def failure_record(self, rank: int) -> Path:
        return self.failures / RANK_RECORD.format(rank=rank)

    def stack_dump(self, rank: int) -> Path:
        return self.stacks / STACK_DUMP.format(rank=rank)

    def emulated_host(self, first_rank: int) -> Path:
        return self.logs / EMULATED_HOST.format(rank=first_rank)

    def rank_log(self, rank: int | str) -> Path:
        """Rank ``rank``'s log (``"*"``: the pattern of every rank's)."""
        return self.logs / RANK_LOG.format(rank=rank)

    def slurm_job(self, job_id: str = SLURM_JOB) -> Path:
        """submitit's folder of Slurm job ``job_id`` (by default the pattern it is given)."""
        return self.folder / SLURM / job_id

    def wandb_offline_runs(self) -> list[Path]:
        """The offline W&B runs under this dir, oldest first (wandb names them by time)."""
        return sorted(p for p in self.wandb.glob(WANDB_OFFLINE_RUNS) if p.is_dir())

    def profile_trace(self, rank: int | str) -> Path:
        return self.profile / PROFILE_TRACE.format(rank=rank)

    def profile_memory(self, rank: int | str) -> Path:
        return self.profile / PROFILE_MEMORY.format(rank=rank)

    def profile_snapshot(self, rank: int | str, when: str = "") -> Path:
        """A rank's CUDA memory snapshot; ``when="_oom"``: the one an OOM error dumped."""
        return self.profile / PROFILE_SNAPSHOT.format(rank=rank, when=when)

    def nccl_log(self, rank: int | str) -> Path:
        return self.logs / NCCL_LOG.format(rank=rank)

    def step(self, name: str) -> Path:
        return self.checkpoints / name


def is_job_dir(names: Iterator[str] | list[str]) -> bool:
    """A folder holding these entries is a job directory."""
    return RECORD in names


# --- the records' schema ------------------------------------------------------------------
#
# Every record is read through one schema: a hand-edited, copied or half-written record
# must say what is wrong with it, not crash ``jobs status`` (nor make ``jobs stop`` act on
# someone else's job). Fields not named here pass as they are (records from newer code).

# A Slurm job id: digits, optionally ``_<array task>`` or ``+<het component>``; a local
# one: ``local-<pid>`` of its supervisor (batch/supervise.py).
SLURM_JOB_ID = re.compile(r"\d+(?:_\d+|\+\d+)?")
LOCAL_JOB_ID = re.compile(r"local-\d+")
JOB_ID_FORMS = "a Slurm id (digits, optionally _<array> or +<het>) or local-<pid>"
NUMBER = (int, float)
NONE = type(None)


class RecordError(ValueError):
    """A record that cannot be trusted: not JSON, not an object, a required field missing,
    a field of the wrong type or a job id in neither known form. The message names the
    file and why (``job.json: job_ids[0]='local-abc': not a job id ...``)."""


@dataclass(frozen=True)
class Field:
    types: tuple[type, ...]
    required: bool = False
    check: Callable[[object], str | None] | None = None  # why the value is wrong, or None


def is_job_id(value: object) -> bool:
    """Whether ``value`` is a job id in a form the launcher writes."""
    return isinstance(value, str) and bool(
        SLURM_JOB_ID.fullmatch(value) or LOCAL_JOB_ID.fullmatch(value)
    )


def _job_ids_problem(ids: object) -> str | None:
    for i, job_id in enumerate(ids):  # type: ignore[arg-type]
        if not is_job_id(job_id):
            return f"[{i}]={_short(job_id)}: not a job id; expected {JOB_ID_FORMS}"
    return None


def _optional_job_id_problem(job_id: object) -> str | None:
    if job_id == "" or is_job_id(job_id):
        return None
    return f"not a job id; expected {JOB_ID_FORMS} (or empty)"


def _list_of(kind: type | tuple[type, ...], what: str) -> Callable[[object], str | None]:
    def problem(values: object) -> str | None:
        for i, value in enumerate(values):  # type: ignore[arg-type]
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                return f"[{i}]={_short(value)}: not {what}"
        return None

    return problem


def _lineage_problem(entries: object) -> str | None:
    for i, entry in enumerate(entries):  # type: ignore[arg-type]
        if not isinstance(entry, dict) or not isinstance(entry.get("job_dir"), str):
            return f"[{i}]: not an object with a job_dir string"
    return None


def _grid_problem(grid: object) -> str | None:
    for axis, size in grid.items():  # type: ignore[attr-defined]
        if not isinstance(size, int) or isinstance(size, bool):
            return f".{axis}={_short(size)}: not an integer"
    return None


def _attempts_problem(entries: object) -> str | None:
    for i, entry in enumerate(entries):  # type: ignore[arg-type]
        if not isinstance(entry, dict) or not isinstance(entry.get("class"), str):
            return f"[{i}]: not an object with a class string"
    return None


def _chain_problem(chain: object) -> str | None:
    found = schema_problem(chain, CHAIN_SCHEMA)  # type: ignore[arg-type]
    return f".{found}" if found else None


CHAIN_SCHEMA = {  # job.json's ``chain`` (submit/chain.py)
    "state": Field((str,)),
    "attempts": Field((list,), check=_attempts_problem),
    "stop": Field((dict,)),
    "started_at": Field((*NUMBER, NONE)),
    "updated_at": Field(NUMBER),
}
RECORD_TIME = "%Y-%m-%dT%H:%M:%S%z"  # job.json's times for people: submit_time, ended, ...
JOB_RECORD_SCHEMA = {  # job.json (submit/pipeline.py's job_record, and what is added later)
    "job_ids": Field((list,), required=True, check=_job_ids_problem),
    "name": Field((str,)),
    "job_dir": Field((str,)),
    "machine": Field((str,)),
    "scheduler": Field((str,)),
    "model": Field((str,)),
    "status": Field((str,)),
    "grid": Field((dict, NONE), check=_grid_problem),
    "nodes": Field((int,)),
    "tasks_per_node": Field((int,)),
    "steps": Field((int,)),
    "attempt": Field((int,)),
    "lineage": Field((list, NONE), check=_lineage_problem),
    "command_line": Field((list,), check=_list_of(str, "a string")),
    "submit_time": Field((str,)),
    "submitted_at": Field(NUMBER),
    "chain": Field((dict, NONE), check=_chain_problem),
    "recovery": Field((dict, NONE)),
    "recovery_job": Field((str, NONE), check=_optional_job_id_problem),
    "resubmitted_as": Field((str,)),
    "excluded_nodes": Field((list, NONE), check=_list_of(str, "a node name")),
    "slow_nodes": Field((list, NONE)),
    "preflight": Field((dict, NONE)),
    "ended_by": Field((dict, NONE)),
    "ended_at": Field(NUMBER),  # a local job's end (batch/supervise.py), unix seconds
    "provenance": Field((dict, NONE)),  # which code ran (records/provenance.py)
}
SUMMARY_SCHEMA = {  # summary.json (train/loop.py's summarize)
    "steps": Field((int,)),  # a generation job's summary has none
    "final_loss": Field((*NUMBER, NONE)),
    "tokens_per_s": Field((*NUMBER, NONE)),
    "step_time_s": Field((*NUMBER, NONE)),
    "stopped": Field((bool,)),
    "after_training": Field((dict,)),
}
FAILURE_SCHEMA = {  # logs/failures/rank_<r>.json (record_failure)
    "rank": Field((int,), required=True),
    "time": Field(NUMBER, required=True),
    "host": Field((str,)),
    "exception": Field((str,)),
    "tail": Field((list,), check=_list_of(str, "a string")),
    "os_error": Field((str,)),
    "failure_class": Field((str,)),
    "step": Field((int, NONE)),
    "stalled_s": Field(NUMBER),
}
TIMELINE_EVENT_SCHEMA = {  # one line of timeline.jsonl (append_timeline)
    "start": Field(NUMBER, required=True),
    "end": Field(NUMBER, required=True),
    "step": Field((int,)),
    "checkpoint": Field((int,)),
    "eval": Field((int,)),  # an evaluation after that step (useful time, not the step's)
}
STRAGGLERS_SCHEMA = {  # stragglers.json (train/health/watchdog.py)
    "step": Field((int, NONE)),
    "stragglers": Field((list,), check=_list_of(dict, "an object")),
}


def schema_problem(value: object, schema: dict[str, Field]) -> str | None:
    """Why ``value`` does not fit ``schema`` (``field=value: why``), or None."""
    if not isinstance(value, dict):
        return f"a JSON {json_kind(value)}, not an object"
    for name, spec in schema.items():
        if name not in value:
            if spec.required:
                return f"{name}: missing (a required field)"
            continue
        found = value[name]
        wrong_bool = isinstance(found, bool) and bool not in spec.types
        if wrong_bool or not isinstance(found, spec.types):
            wanted = " or ".join(json_kind_name(t) for t in spec.types)
            return f"{name}={_short(found)}: a {json_kind(found)}, expected {wanted}"
        why = spec.check(found) if spec.check and found is not None else None
        if why:  # "[i]=...: why" or ".key=...: why" says where inside the field
            return f"{name}{why}" if why[0] in "[." else f"{name}={_short(found)}: {why}"
    return None


def json_kind(value: object) -> str:
    return json_kind_name(type(value))


def json_kind_name(kind: type) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "integer",
             float: "number", NONE: "null"}  # fmt: skip
    return names.get(kind, kind.__name__)


def _short(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_record(text: str, name: str, schema: dict[str, Field]) -> dict:
    """The record ``name`` holding ``text``, checked against ``schema``; raises RecordError
    (``<name>: <why>``)."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise RecordError(f"{name}: not JSON ({error})") from None
    why = schema_problem(value, schema)
    if why:
        raise RecordError(f"{name}: {why}")
    return value


def read_checked(path: Path, schema: dict[str, Field], name: str | None = None) -> dict:
    """``path``'s record, checked; OSError when it cannot be read, RecordError when what
    it holds is not such a record."""
    return parse_record(path.read_text(errors="replace"), name or path.name, schema)


# --- job.json ------------------------------------------------------------------------------


def read_record(job_dir: str | Path) -> dict:
    """job.json, checked (``JOB_RECORD_SCHEMA``): OSError when missing or unreadable,
    RecordError (a ValueError) when it is not a record the launcher writes."""
    return read_checked(JobPaths(job_dir).record, JOB_RECORD_SCHEMA)


def read_record_or_empty(job_dir: str | Path) -> dict:
    """job.json, or {} when it is missing or fails its schema."""
    try:
        return read_record(job_dir)
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    """Exclusive lock across processes on ``path`` (created if missing)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def job_lock(job_dir: str | Path) -> contextlib.AbstractContextManager[None]:
    """Exclusive per-job lock across processes, held while a resubmission launches."""
    return _flock(Path(job_dir) / RESUBMIT_LOCK)


def record_lock(job_dir: str | Path) -> contextlib.AbstractContextManager[None]:
    """Exclusive lock on job.json's read-modify-write (launcher, job and tools all write it);
    not ``job_lock``, which a resubmission holds while it launches."""
    return _flock(Path(job_dir) / RECORD_LOCK)


def write_record_file(job_dir: str | Path, record: dict) -> None:
    """Replace job.json atomically (callers hold ``record_lock``); a write that fails (a
    full disk) raises and leaves no temporary file behind."""
    path = JobPaths(job_dir).record
    _replace_atomically(path, json.dumps(record, indent=2, sort_keys=True))


def _replace_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``;
    on failure remove the temporary file and raise. The temporary file is this thread's
    own (an emulated host's ranks are threads of one process)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def update_record(job_dir: str | Path, **updates) -> dict:
    """Re-read job.json, apply ``updates`` and replace the file atomically."""
    with record_lock(job_dir):
        record = read_record(job_dir)
        record.update(updates)
        write_record_file(job_dir, record)
    return record


def attempt_number(job_dir: str | Path) -> int:
    """Which attempt of its run this job dir holds (1: the launch itself)."""
    try:
        return int(read_record_or_empty(job_dir).get("attempt") or 1)
    except (TypeError, ValueError):
        return 1


def run_root(job_dir: str | Path, record: dict | None = None) -> Path:
    """The run's first attempt (``lineage[0]``), which holds what all its attempts share
    (the chain, the curves); the dir itself for a first attempt. ``record``: its job.json
    when already read."""
    record = read_record_or_empty(job_dir) if record is None else record
    lineage = record.get("lineage") or []
    first = lineage[0] if lineage and isinstance(lineage[0], dict) else {}
    return Path(first.get("job_dir") or job_dir)


def last_job_id(record: dict) -> str:
    """The scheduler's id of the record's newest job ('' before submission)."""
    ids = record.get("job_ids") or []
    return str(ids[-1]) if ids else ""


# --- what the job writes -------------------------------------------------------------------


def read_summary(job_dir: str | Path) -> dict | None:
    """``summary.json``, which rank 0 writes when the run ends; None before, or when it
    fails its schema (``record_problems`` says why)."""
    try:
        return read_checked(JobPaths(job_dir).summary, SUMMARY_SCHEMA)
    except (OSError, ValueError):
        return None


def write_summary(job_dir: str | Path, summary: dict) -> None:
    """Replace summary.json whole, so that a reader never sees half of it."""
    _replace_atomically(JobPaths(job_dir).summary, json.dumps(summary, indent=2) + "\n")


def last_metrics(job_dir: str | Path) -> dict | None:
    """The last complete row of metrics.jsonl, reading only the end of the file."""
    try:
        with open(JobPaths(job_dir).metrics, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            tail = handle.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        row = metrics_row(line)
        if row is not None:
            return row
    return None


def metrics_row(line: str) -> dict | None:
    """One metrics.jsonl row, or None when ``line`` is not a whole row (a line cut off when
    the disk filled mid-write)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def metrics_through(path: Path, step: int) -> tuple[list[str], int]:
    """The whole rows of the metrics file ``path`` up to ``step`` (what a resume from that
    step keeps), and how many lines were not whole rows."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return [], 0
    rows = [(line, metrics_row(line)) for line in lines]
    kept = [line for line, row in rows if row is not None and row["step"] <= step]
    return kept, sum(1 for _, row in rows if row is None)


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline whole, or not at all: one ``write``; a short or failed
    write (the disk filled mid-line) is cut back to where the file ended, then raised, so
    a reader never meets half a line."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def append_timeline(job_dir: str | Path, event: dict) -> None:
    """One event of this attempt (rank 0): a step, a checkpoint save or an evaluation, with
    its wall-clock ``start`` and ``end``. Goodput (``records/goodput.py``) is read from
    these."""
    append_line(JobPaths(job_dir).timeline, json.dumps(event))


def read_timeline(job_dir: str | Path) -> list[dict]:
    """The attempt's whole timeline events in order (a line cut off by a crash is left out)."""
    try:
        lines = JobPaths(job_dir).timeline.read_text().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if schema_problem(event, TIMELINE_EVENT_SCHEMA) is None:
                events.append(event)
    return events


def record_failure(
    job_dir: str | Path, rank: int, error: BaseException, evidence: dict | None = None
) -> None:
    """Called by a rank that is about to die of ``error``; never raises itself.

    ``evidence``: what a rank that diagnosed the failure itself adds (the watchdog's hang,
    the non-finite guard): ``failure_class`` (``hang`` or ``non_finite``), and for a hang
    ``section``, ``step``, ``stalled_s``, ``suspects`` (``[{"rank", "node"}]``: the ranks
    that stopped making progress) and ``stacks`` (the folder of the stack dumps); for a
    non-finite step ``step`` and ``first`` (``loss`` or ``gradients``).

    ``os_error``: the errno text of the OSError behind ``error`` (its causes, or a DCP
    save's per-rank failures), so that a checkpoint save that failed on a full disk is
    classed as a storage fault, not by the RuntimeError that wraps it."""
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    text = "".join(lines).rstrip().splitlines()
    record = {
        "rank": rank,
        "host": node_name(),
        "time": time.time(),
        "exception": f"{type(error).__name__}: {error}".splitlines()[0][:500],
        "tail": text[-FAILURE_TAIL_LINES:],
    }
    cause = os_error_of(error)
    if cause is not None:
        record["os_error"] = str(cause).splitlines()[0][:500]
    record |= evidence or {}
    final = JobPaths(job_dir).failure_record(rank)
    # the traceback still reaches the rank's own log; two threads of the rank (its
    # watchdog's and its main one) may record at once: each writes a file of its own
    with contextlib.suppress(OSError):
        final.parent.mkdir(parents=True, exist_ok=True)
        _replace_atomically(final, json.dumps(record))


def os_error_of(error: BaseException) -> OSError | None:
    """The first OSError with an errno in ``error``, its causes and contexts, and the
    per-rank exceptions a DCP ``CheckpointException`` holds (``failures``: rank ->
    (exception, trace)), breadth first; None without one."""
    seen: set[int] = set()
    queue: list[BaseException | None] = [error]
    while queue:
        found = queue.pop(0)
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, OSError) and found.errno:
            return found
        queue += [found.__cause__, found.__context__]
        per_rank = getattr(found, "failures", None)
        if isinstance(per_rank, dict):
            for value in per_rank.values():
                inner = value[0] if isinstance(value, tuple) and value else value
                if isinstance(inner, BaseException):
                    queue.append(inner)
    return None


def read_failures(job_dir: str | Path) -> list[dict]:
    """The failure records the ranks left, oldest first; one that fails its schema is
    left out (``record_problems`` names it)."""
    records = []
    for path in JobPaths(job_dir).failures.glob("rank_*.json"):
        try:
            records.append(read_checked(path, FAILURE_SCHEMA))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: (r["time"], r["rank"]))


# --- checkpoints ---------------------------------------------------------------------------


class CheckpointMissing(ValueError):
    """No complete checkpoint where one was named."""


# What ``checkpoints/latest`` may name: a step directory of this job dir's checkpoints/.
STEP_NAME = re.compile(r"step_\d+")


def latest_step_name(job_dir: str | Path) -> str | None:
    """The step directory ``checkpoints/latest`` names (``step_<n>``), or None without one.
    Only a ``step_<digits>`` counts: a pointer to anything else (another dir's step, an
    absolute path, garbage) is not followed, and the newest complete step here stands in
    for it, as the job's resume does (``train/checkpoint/manager.py``)."""
    try:
        text = JobPaths(job_dir).latest.read_text(errors="replace").strip()
    except OSError:
        return None
    return text if STEP_NAME.fullmatch(text) else newest_complete_step(job_dir)


def newest_complete_step(job_dir: str | Path) -> str | None:
    """The newest ``step_<n>`` of ``checkpoints/`` whose meta.json is written, or None."""
    steps = [
        (int(path.name.removeprefix("step_")), path.name)
        for path in JobPaths(job_dir).checkpoints.glob("step_*")
        if STEP_NAME.fullmatch(path.name) and (path / STEP_META).is_file()
    ]
    return max(steps)[1] if steps else None


def checkpointed_step(job_dir: str | Path) -> int:
    """Step of the checkpoint the job will resume from (0 without one)."""
    name = latest_step_name(job_dir)
    try:
        return int(name.rsplit("_", 1)[-1]) if name else 0
    except ValueError:
        return 0


def read_step_meta(step_dir: Path) -> dict:
    return json.loads((step_dir / STEP_META).read_text())


def checkpoint_bytes(step_dir: Path) -> int:
    """Bytes the files of one checkpoint step directory hold (0 when it is missing)."""
    total = 0
    for folder, _, names in os.walk(step_dir):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


def remove_interrupted_saves(job_dir: str | Path) -> int:
    """Delete the ``.tmp_step_*`` leftovers of interrupted checkpoint saves; returns how
    many. Only when no rank of the job runs (a save may be in flight otherwise): what a
    resume would remove anyway, and on a full disk the room a final record needs."""
    removed = 0
    for stale in JobPaths(job_dir).checkpoints.glob(INTERRUPTED_SAVES):
        shutil.rmtree(stale, ignore_errors=True)
        removed += 1
    return removed


def resolve_checkpoint(text: str) -> Path:
    """The step directory named by ``text`` (itself, or a job directory's latest)."""
    path = Path(text)
    name = latest_step_name(path)
    if name:
        path = JobPaths(path).step(name)
    if not (path / STEP_META).is_file():
        raise CheckpointMissing(
            f"checkpoint={text!r}: no complete checkpoint there (no {STEP_META}); expected a "
            f"{CHECKPOINTS}/step_N directory or a job directory with {CHECKPOINTS}/{LATEST}"
        )
    return path


# --- watchdog, stragglers and rollbacks ------------------------------------------------------


def read_json_or_none(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json_atomically(path: Path, value: dict | list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_atomically(path, json.dumps(value) + "\n")


def read_stragglers(job_dir: str | Path) -> dict | None:
    """The newest straggler report: ``{"step", "median_s", "stragglers": [{"rank", "node",
    "compute_s", "ratio", "score"}]}``; None when no rank was ever named."""
    try:
        return read_checked(JobPaths(job_dir).stragglers, STRAGGLERS_SCHEMA)
    except (OSError, ValueError):
        return None


def record_problems(job_dir: str | Path) -> list[str]:
    """``UNREADABLE <record>: <why>`` for each record besides job.json that is there but
    fails its schema (summary.json, stragglers.json, the failure records): the readers
    leave such a record out, and ``jobs status`` says so rather than drop it silently."""
    paths = JobPaths(job_dir)
    checked = [(paths.summary, SUMMARY_SCHEMA), (paths.stragglers, STRAGGLERS_SCHEMA)]
    checked += [(path, FAILURE_SCHEMA) for path in sorted(paths.failures.glob("rank_*.json"))]
    problems = []
    for path, schema in checked:
        try:
            read_checked(path, schema, str(path.relative_to(paths.folder)))
        except OSError:
            continue
        except RecordError as error:
            problems.append(f"UNREADABLE {error}")
    return problems


def skipped_steps(job_dir: str | Path) -> list[int]:
    """Steps (1-based) whose batch the job skips: a rollback after a non-finite step."""
    found = read_json_or_none(JobPaths(job_dir).skipped_steps)
    return sorted(int(s) for s in found) if isinstance(found, list) else []


def add_skipped_step(job_dir: str | Path, step: int) -> None:
    write_json_atomically(
        JobPaths(job_dir).skipped_steps, sorted({*skipped_steps(job_dir), int(step)})
    )
