"""What happened to each job: its state, the step it reached, its loss, and when it failed,
its failure class and the evidence for it (``records/failures.py``).

States come from one batched ``sacct`` call for all jobs; without accounting, from
``squeue`` for queued jobs and from submitit's result pickles and the logs for ended ones.
A job the preflight stopped counts as a node failure of the slow nodes it named.

Login-node code: never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from axonn_launch.common import slurmtext
from axonn_launch.common.durations import duration
from axonn_launch.common.jobdir import (
    CHECKPOINTS,
    HYDRA,
    LOGS,
    PACK_PLAN,
    PACKS,
    PREFLIGHT,
    RANK_LOG,
    RECORD,
    SLURM,
    SLURM_RESULT,
    SLURM_STDERR,
    SLURM_STDOUT,
    SUBMITIT,
    JobPaths,
    RecordError,
    checkpoint_bytes,
    is_job_dir,
    last_job_id,
    last_metrics,
    latest_step_name,
    read_failures,
    read_record,
    read_record_or_empty,
    read_stragglers,
    read_summary,
    record_problems,
    run_root,
    update_record,
)
from axonn_launch.records import failures, firstfail, goodput, provenance
from axonn_launch.records.failures import Diagnosis, Evidence

DEFAULT_ROOT = "jobs"
SKIP_DIRS = frozenset({SLURM, CHECKPOINTS, LOGS, HYDRA, SUBMITIT})
LOG_TAIL_BYTES = 16384
NODE_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")  # what may go into --exclude


@dataclass(frozen=True)
class SchedulerInfo:
    state: str = ""
    exit_code: str = ""
    nodelist: str = ""
    times: tuple[float, float, float] | None = None  # submit, start, end once ended
    # every ended allocation (submit, start, end), oldest first: a job requeued in place
    # (a time limit, a preemption) ran in several (sacct -D)
    allocations: tuple[tuple[float, float, float], ...] = ()
    # nodes a resize took from the job (sacct's RESIZING rows' nodes the newest row lacks):
    # a failed node of a ``--no-kill`` job, its batch host included
    lost_nodes: tuple[str, ...] = ()


@dataclass
class JobStatus:
    job_dir: str
    job_id: str
    name: str
    machine: str
    model: str
    grid: str
    nodes: int
    state: str
    step: int | None
    steps: int
    loss: float | None
    tokens_per_s: float | None
    step_time_s: float | None
    failure: str
    action: str
    reason: str
    attempt: int
    bad_nodes: list[str] = field(default_factory=list)
    resubmitted_as: str = ""
    slow_nodes: list[str] = field(default_factory=list)  # named by this attempt's preflight
    # what ran after the training (sample, memorization): "done", "failed: ..." or "pending"
    after_training: dict[str, str] = field(default_factory=dict)
    run_dir: str = ""  # the run's first attempt (its own dir for a run of one attempt)
    # a run that recovers itself (submit/chain.py): running, waiting, recovering, done, stopped
    run_state: str = ""
    attempts: int = 1  # attempts of the run so far
    excluded: list[str] = field(default_factory=list)  # nodes its newest attempt leaves out
    stop_reason: str = ""
    allocation: list[float] = field(default_factory=list)  # submit, start, end once ended
    goodput: dict = field(default_factory=dict)  # the run's (records/goodput.py), once ended
    # every allocation of the job (a requeued job has several: sacct -D), oldest first
    allocations: list[list[float]] = field(default_factory=list)
    # a hang's section, step, stall, suspects and stacks; a non-finite step's step and
    # first (loss or gradients): what the diagnosing rank recorded (records/failures.py)
    detail: dict = field(default_factory=dict)
    # the newest straggler report's ranks (stragglers.json): rank, node, ratio, ...
    stragglers: list[dict] = field(default_factory=list)
    straggler_step: int | None = None  # the step of that report
    # "UNREADABLE <record>: <why>" for each record that failed its schema (common/jobdir.py),
    # and a warning when the installed code differs from the job's (records/provenance.py)
    problems: list[str] = field(default_factory=list)
    # when each restart in place of this attempt's job began (submit/in_job.py), in order
    restarts_in_place: list[float] = field(default_factory=list)
    charged_nodes: int = 0  # the nodes its allocation held (spares too), from the scheduler
    # a pending attempt's start as Slurm estimates it (squeue --start), or why there is none
    expected_start: str = ""
    # Slurm could not be asked (squeue and sacct failed): its last known state and age;
    # the job is shown, never classed, resubmitted or stopped, until Slurm answers
    unreachable: str = ""

    @property
    def allocations_held(self) -> int:
        """The Slurm allocations the run's attempts held (a restart in place holds none)."""
        return max(1, self.attempts - len(self.restarts_in_place))


RUN_RUNNING, RUN_WAITING, RUN_RECOVERING, RUN_DONE, RUN_STOPPED = (
    "running", "waiting", "recovering", "done", "stopped",
)  # fmt: skip
RUN_DRY_RUN, RUN_REFUSED = "dry run", "refused"  # runs that never started


def run_state(root: Path, root_record: dict | None = None) -> str:
    """A self-recovering run's state now: the chain's word, or done once its newest attempt
    finished training (no recovery step runs after a success: Slurm cancels it); '' for
    a run without recovery. ``root_record``: the root's job.json when already read."""
    record = read_record_or_empty(root) if root_record is None else root_record
    chain = dict(record.get("chain") or {})
    if not chain and "recovery" not in record:
        return ""
    if is_dry_run(record) or record.get("status") == "refused":  # nothing ever ran
        return RUN_DRY_RUN if is_dry_run(record) else RUN_REFUSED
    state = chain.get("state", RUN_RUNNING)
    if state in (RUN_RUNNING, RUN_RECOVERING):
        current = Path(chain.get("current") or root)
        summary = read_summary(current)
        steps = int(read_record_or_empty(current).get("steps") or 1)
        if summary is not None and int(summary.get("steps", 0)) >= steps:
            return RUN_DONE
    return state


def runs(rows: list[JobStatus]) -> list[JobStatus]:
    """One row per run: its newest attempt, with the run's attempts, state, last class,
    excluded nodes and (once stopped) why. A run of one attempt keeps its row."""
    grouped: dict[str, list[JobStatus]] = {}
    for row in rows:
        grouped.setdefault(str(Path(row.run_dir or row.job_dir).resolve()), []).append(row)
    shown = []
    for root, group in grouped.items():
        newest = max(group, key=lambda r: r.attempt)
        newest = replace(newest, goodput=goodput_of(group))
        if len(group) == 1 and not newest.run_state:
            shown.append(newest)  # a run of one attempt, without recovery: its row as it is
            continue
        record = read_record_or_empty(Path(root))
        chain = dict(record.get("chain") or {})
        state = run_state(Path(root), record)
        if state == RUN_RUNNING and newest.state.startswith("PENDING"):
            state = RUN_WAITING
        history = chain.get("attempts") or []
        unclassed = newest.failure in ("", "running") and not newest.unreachable
        last = history[-1]["class"] if history and unclassed else ""
        in_place = sum(len(r.restarts_in_place) for r in group)
        shown.append(replace(
            newest, run_state=state, attempts=max(len(group), newest.attempt) + in_place,
            failure=newest.failure or last,
            **{"stop_reason": str((chain.get("stop") or {}).get("reason", "")),
               **user_stop(chain, newest.failure)},
        ))  # fmt: skip
    return shown


USER_STOP = "jobs stop"  # chain.stop's reason (submit/chain.py)
USER_STOP_WORDS = "stopped by the user (python -m axonn_launch.jobs stop)"


def user_stop(chain: dict, failure: str) -> dict:
    """A run that ``jobs stop`` ended: its cancelled attempt was stopped by the user, and
    nothing is to be done (not sacct's ``CANCELLED by <uid>`` and cancelled's resume)."""
    if not chain.get("stopped_by_user") or failure != failures.CANCELLED:
        return {}
    return {"state": f"CANCELLED ({USER_STOP})", "reason": USER_STOP_WORDS,
            "action": failures.STOP, "stop_reason": USER_STOP}  # fmt: skip


def goodput_of(group: list[JobStatus]) -> dict:
    """The run's goodput once all its attempts ended ({} before, or without timelines);
    from its newest extension on (``jobs resubmit <completed> train.steps=N``): the time
    before one was the user's choice, not a loss."""
    attempts = sorted(group, key=lambda r: r.attempt)
    ended = [i for i, r in enumerate(attempts[:-1], 1) if r.failure == failures.COMPLETED]
    attempts = attempts[ended[-1] :] if ended else attempts
    if any(len(r.allocation) != 3 for r in attempts):
        return {}
    allocations = [
        goodput.Allocation(Path(r.job_dir), *times, nodes=r.charged_nodes or r.nodes)
        for r in attempts
        for times in (r.allocations or [r.allocation])
    ]
    found = goodput.of_run(allocations, finished=attempts[-1].failure == failures.COMPLETED)
    return found.as_dict() if found else {}


# --- finding and reading job directories -------------------------------------------------


JOB_DIR_HINT = (
    "a job dir is the folder one launch writes, holding job.json"
    " (python -m axonn_launch makes jobs/<name>/<time>/)"
)


class NotAJobPath(ValueError):
    """A PATH argument with no job dir at or below it; the message says what one is."""


def find_job_dirs(paths: list[str]) -> list[Path]:
    """Every directory holding a job.json at or below ``paths``, in a stable order.

    Raises NotAJobPath for a path with none: a typo must not look like "nothing to do".
    """
    found: list[Path] = []
    for path in paths:
        here: list[Path] = []
        _walk(Path(path), here)
        if not here:
            what = "holds no job dir" if os.path.exists(path) else "no such file or directory"
            raise NotAJobPath(f"{path}: {what}; {JOB_DIR_HINT}")
        found += here
    return sorted(set(found))


def pack_lines(paths: list[str], rows: list[JobStatus]) -> list[str]:
    """One line per pack of the packed sweeps under ``paths`` (``submit/pack.py``): its job,
    size and points, with how many of them ended in each class so far."""
    by_dir = {str(Path(r.job_dir).resolve()): r for r in rows}
    lines = []
    for path in paths:
        folder = Path(path) / PACKS
        found = [p for p in folder.glob("*") if p.name.isdigit() and (p / PACK_PLAN).is_file()]
        for pack in sorted(found, key=lambda p: int(p.name)):
            plan = json.loads((pack / PACK_PLAN).read_text())
            points = plan.get("points") or []
            shown = [by_dir.get(str(Path(p["job_dir"]).resolve())) for p in points]
            classes = Counter(pack_word(r) for r in shown if r)
            counted = ", ".join(f"{n} {word}" for word, n in sorted(classes.items()))
            nums = ",".join(str(p["num"]) for p in points)
            job = f"job {plan['job_id']}" if plan.get("job_id") else "not submitted"
            size = (f"{len(points)} array tasks" if plan.get("array")
                    else f"{plan['nodes']} nodes x {plan['minutes']} min")  # fmt: skip
            word = "array" if plan.get("array") else "pack"
            lines.append(f"{word} {pack.name}: {job}, {size}, points {nums}:"
                         f" {counted or 'no status yet'}")  # fmt: skip
    return lines


def pack_word(row: JobStatus) -> str:
    """A packed point's word in its pack's line: its class, ``pending`` while queued (not
    ``running``), or why Slurm holds its pack for good."""
    if row.expected_start.startswith(HELD_WORDS):
        return row.expected_start.split(":")[0]
    return "pending" if row.state.startswith("PENDING") else row.failure or row.state.lower()


def _walk(path: Path, found: list[Path]) -> None:
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return
    if is_job_dir([e.name for e in entries]):
        found.append(path)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and entry.name not in SKIP_DIRS:
            _walk(Path(entry.path), found)


DRY_RUN_STATE = "DRY_RUN"
DRY_RUN_WORDS = "is a dry run: nothing was trained; launch it without dry_run=true"


def is_dry_run(record: dict) -> bool:
    """The launch only rendered and recorded the job (``dry_run=true``): nothing ran."""
    return bool(record.get("dry_run")) or record.get("status") == "dry_run"


def dry_run_problem(job_dir: Path | str) -> str | None:
    """The one line for a tool asked for what only a run makes (report, generate), or None."""
    try:
        record = read_record(Path(job_dir))
    except (OSError, ValueError):
        return None
    if not is_dry_run(record):
        return None
    return f"{job_dir}: {DRY_RUN_WORDS}"


def saved_config(job_dir: Path | str) -> dict | None:
    """The resolved config the launch saved in the job dir (None when unreadable)."""
    try:
        import yaml

        found = yaml.safe_load(JobPaths(job_dir).config.read_text())
    except Exception:
        return None
    return found if isinstance(found, dict) else None


@dataclass(frozen=True)
class RunResults:
    """Loss and speed of a run: its summary once it finished, else its last step."""

    loss: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None


def run_results(job_dir: Path, metrics: dict | None = None) -> RunResults:
    """From summary.json while it is the newest evidence, else from ``metrics`` (the last
    step's row, read if not given): a requeued allocation's own steps, not the summary the
    previous allocation left when it stopped."""
    row = metrics if metrics is not None else last_metrics(Path(job_dir)) or {}
    summary = current_summary(Path(job_dir), row)
    if summary is None:
        summary = {"final_loss": row.get("loss"), **row}
    values = [summary.get(k) for k in ("final_loss", "tokens_per_s", "step_time_s")]
    return RunResults(*(_finite(v) for v in values))


def current_summary(job_dir: Path, row: dict) -> dict | None:
    """summary.json, unless metrics.jsonl's last row ``row`` is newer evidence: a step past
    the summary's, or rows written after it (a requeued or resumed allocation appends to
    metrics.jsonl, or cuts it back to its checkpoint, while the summary its predecessor
    wrote on stopping is still there). A finished run writes its summary after its last
    row, so the summary stands."""
    summary = read_summary(job_dir)
    if summary is None or not row:
        return summary
    if int(row.get("step") or 0) > int(summary.get("steps") or 0):
        return None
    paths = JobPaths(job_dir)
    try:
        newer = paths.metrics.stat().st_mtime_ns > paths.summary.stat().st_mtime_ns
    except OSError:  # one of them went away meanwhile: the summary was read, keep it
        return summary
    return None if newer else summary


def _finite(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def preflight_of(job_dir: Path, record: dict) -> dict | None:
    """The preflight verdict of the job ``record`` names now: job.json's, else the job's
    own ``preflight.json`` (written a moment before job.json could be); None for another
    job's (a reused job dir) or none at all."""
    job_id = last_job_id(record)
    found = record.get("preflight")
    if not (isinstance(found, dict) and found.get("job_id") == job_id):
        try:
            found = json.loads((Path(job_dir) / PREFLIGHT).read_text())
        except (OSError, ValueError):
            return None
    return found if isinstance(found, dict) and job_id and found.get("job_id") == job_id else None


def slow_nodes_of(preflight: dict | None) -> list[str]:
    """The preflight's slow nodes that are plain node names (they go into --exclude)."""
    nodes = (preflight or {}).get("slow_nodes") or []
    return [str(n) for n in nodes if NODE_NAME.fullmatch(str(n))] if isinstance(nodes, list) else []


# --- the scheduler's view ------------------------------------------------------------------


@dataclass(frozen=True)
class SchedulerView:
    """What Slurm said of the jobs: their states, and why it could not be asked at all
    (``unreachable``: neither sacct nor squeue answered; '' when one did)."""

    infos: dict[str, SchedulerInfo] = field(default_factory=dict)
    unreachable: str = ""


def scheduler_states(job_ids: list[str]) -> dict[str, SchedulerInfo]:
    """State of every Slurm job in ``job_ids``: one sacct call, or squeue without accounting."""
    return scheduler_view(job_ids).infos


def scheduler_view(job_ids: list[str]) -> SchedulerView:
    """The states of the Slurm jobs in ``job_ids``: one sacct call, or squeue without
    accounting; when neither answers, no state at all and why (never an empty queue)."""
    ids = sorted({j for j in job_ids if j and not j.startswith("local-")})
    if not ids:
        return SchedulerView()
    out, sacct_said = command_result([*slurmtext.sacct_command(ids), "--duplicates"])
    if out is not None:
        return SchedulerView(sacct_infos(out))
    queued, squeue_said = command_result(slurmtext.squeue_command())
    if queued is None:
        return SchedulerView({}, f"squeue: {squeue_said}; sacct: {sacct_said}")
    return SchedulerView(squeue_infos(queued, ids))


def sacct_states(job_ids: list[str]) -> dict[str, SchedulerInfo] | None:
    """None when sacct is missing or fails (no accounting). Asked with ``--duplicates``:
    without it sacct shows a requeued job's newest allocation only, and the earlier ones
    (allocated time, maybe hung) would pass for time in the queue."""
    out = command_output([*slurmtext.sacct_command(job_ids), "--duplicates"])
    return None if out is None else sacct_infos(out)


def sacct_infos(text: str) -> dict[str, SchedulerInfo]:
    """``sacct -X -D`` rows by job id: the state of its newest row (the one without an end
    yet, else the latest submitted: Slurm resets a requeued job's submit time), and every
    ended allocation."""
    rows: dict[str, list[slurmtext.JobRow]] = {}
    for line in text.splitlines():
        for job, row in slurmtext.parse_sacct(line).items():
            rows.setdefault(job, []).append(row)
    infos = {}
    for job, found in rows.items():
        ongoing = [r for r in found if r.times is None]
        ended = sorted((r for r in found if r.times), key=lambda r: (r.times[0], r.times[1]))
        newest = ongoing[-1] if ongoing else ended[-1]
        allocations = tuple(r.times for r in ended if r.times)
        lost = resized_away(found, newest)
        infos[job] = SchedulerInfo(
            newest.state, newest.exit_code, newest.nodelist, newest.times, allocations, lost
        )
    return infos


def resized_away(rows: list[slurmtext.JobRow], newest: slurmtext.JobRow) -> tuple[str, ...]:
    """The nodes of the job's RESIZING rows that its newest row does not hold."""
    kept = set(failures.expand_nodelist(newest.nodelist))
    lost = [n for r in rows if failures.base_state(r.state) == "RESIZING"
            for n in failures.expand_nodelist(r.nodelist) if n not in kept]  # fmt: skip
    return tuple(dict.fromkeys(lost))


def expected_starts(job_ids: list[str]) -> dict[str, str]:
    """For each pending Slurm job, when Slurm expects it to start and why it waits
    (``squeue --start``: its scheduler's estimate, N/A before one is made); one call."""
    if not job_ids:
        return {}
    command = ["squeue", "-h", "--start", "-j", ",".join(sorted(job_ids)), "-o", "%i|%S|%r"]
    found = {}
    for line in (command_output(command) or "").splitlines():
        job, _, rest = line.strip().partition("|")
        when, _, why = rest.partition("|")
        if job:
            found[job] = start_words(when.strip(), why.strip())
    return found


# squeue reasons a pending job never leaves by waiting: it asks more than its partition,
# account or QOS ever allows (a pack sized beyond its partition, ``submit/pack.py``)
NEVER_CLEARS = ("PartitionNodeLimit", "PartitionTimeLimit", "AssocMaxNodesPerJob",
                "AssocMaxWallDurationPerJobLimit", "QOSMaxNodePerJobLimit",
                "QOSMaxWallDurationPerJobLimit", "PartitionConfig", "BadConstraints",
                "InvalidAccount", "InvalidQOS")  # fmt: skip
HELD_WORDS = "held by Slurm for good"


def held_for_good(why: str) -> bool:
    """Whether squeue's reason ``why`` for a pending job can never clear."""
    return why.split(",")[0].strip() in NEVER_CLEARS


def start_words(when: str, why: str) -> str:
    """``pending: Slurm expects it to start at 2026-12-06 05:10:00 (squeue --start); it
    waits for: Priority``; for a reason that never clears, that it never starts."""
    if held_for_good(why):
        return (f"{HELD_WORDS} ({why}, squeue): it will never start; cancel it (jobs stop)"
                " and submit it within the partition's limits")  # fmt: skip
    known = re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d", when) is not None  # else N/A, Unknown
    said = (
        f"pending: Slurm expects it to start at {when.replace('T', ' ')} (squeue --start)"
        if known
        else "pending: Slurm has no start estimate yet (squeue --start)"
    )
    return f"{said}; it waits for: {why}" if why and why != "None" else said


def squeue_states(job_ids: list[str]) -> dict[str, SchedulerInfo]:
    """Queued and running jobs only; a job squeue does not list has ended."""
    return squeue_infos(command_output(slurmtext.squeue_command()) or "", job_ids)


def squeue_infos(text: str, job_ids: list[str]) -> dict[str, SchedulerInfo]:
    """The rows of ``squeue`` output ``text`` for ``job_ids``."""
    rows, wanted = slurmtext.parse_squeue(text), set(job_ids)
    return {job: SchedulerInfo(r.state, "", r.nodelist) for job, r in rows.items() if job in wanted}


def command_output(command: list[str]) -> str | None:
    return command_result(command)[0]


def command_result(command: list[str]) -> tuple[str | None, str]:
    """(stdout, '') of a command that succeeded; (None, why) of one that did not run,
    timed out or failed: its last line on stderr, or its exit code."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, str(error)
    if proc.returncode == 0:
        return proc.stdout, ""
    said = proc.stderr.strip().splitlines()
    last = said[-1].removeprefix(f"{command[0]}: ") if said else f"exit code {proc.returncode}"
    return None, last[:200]


# --- evidence from the job directory -------------------------------------------------------


def slurm_task_files(job_dir: Path, job_id: str) -> dict[str, dict[int, str]]:
    """``<job_dir>/slurm/<id>/<id>_<task>_<kind>`` as kind -> task -> path, one listing.

    Kinds: ``result.pkl``, ``log.out``, ``log.err``.
    """
    folder = JobPaths(job_dir).slurm_job(job_id)
    prefix = job_id + "_"
    files: dict[str, dict[int, str]] = {SLURM_RESULT: {}, SLURM_STDOUT: {}, SLURM_STDERR: {}}
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            task, _, kind = entry.name[len(prefix) :].partition("_")
            if entry.name.startswith(prefix) and kind in files and task.isdigit():
                files[kind][int(task)] = entry.path
    return files


def read_results(paths: dict[int, str]) -> tuple[tuple[str, str], ...]:
    """submitit result pickles: ("success", value) or ("error", traceback) per task."""
    results = []
    for task in sorted(paths):
        try:
            with open(paths[task], "rb") as handle:
                outcome, value = pickle.load(handle)
        except Exception as exc:  # unreadable or truncated: report, do not crash
            outcome, value = "error", f"unreadable result pickle {paths[task]}: {exc}"
        results.append((str(outcome), value if outcome == "error" else ""))
    return tuple(results)


def tail(path: Path | str, size: int = LOG_TAIL_BYTES, start: int = 0) -> str:
    """The last ``size`` bytes of a file, none from before byte ``start``."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(start, handle.tell() - size))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def log_sizes(job_dir: Path, job_id: str) -> dict[str, int]:
    """The size of each task log of a Slurm job now (path -> bytes): where the next step's
    lines begin (``step_evidence``)."""
    files = slurm_task_files(job_dir, job_id)
    paths = [*files[SLURM_STDOUT].values(), *files[SLURM_STDERR].values()]
    return {path: os.path.getsize(path) for path in paths if os.path.exists(path)}


def step_evidence(job_dir: Path, step: EndedStep) -> Evidence:
    """What is known about one ended srun step of a running Slurm job (a restart in place:
    ``submit/in_job.py``): its exit status, result pickles, the lines its tasks logged
    after ``step.offsets`` and its ranks' failure records since it began."""
    files = slurm_task_files(job_dir, step.job_id)
    logs = {t: tail(p, start=step.offsets.get(p, 0)) for t, p in files[SLURM_STDERR].items()}
    if 0 in files[SLURM_STDOUT]:
        out = files[SLURM_STDOUT][0]
        logs[0] = tail(out, start=step.offsets.get(out, 0)) + "\n" + logs.get(0, "")
    found = tuple(
        r for r in read_failures(job_dir) if _record_time(r) >= step.started - RECORD_CLOCK_SLACK_S
    )
    texts = ["\n".join([str(r.get("exception", "")), str(r.get("os_error", "")),
                        *r.get("tail", [])]) for r in found]  # fmt: skip
    return Evidence(
        exit_code=f"{step.exit_status}:0",
        results=read_results(files[SLURM_RESULT]),
        expected_results=len(step.nodes) * step.tasks_per_node,
        logs=logs,
        nodes=tuple(step.nodes),
        tasks_per_node=step.tasks_per_node,
        records=tuple(texts),
        failure_records=found,
    )


@dataclass(frozen=True)
class EndedStep:
    """An srun step of a running job that ended: its exit status, nodes, tasks per node,
    when it began and where its lines begin in each task log (``log_sizes``)."""

    job_id: str
    exit_status: int
    nodes: tuple[str, ...]
    tasks_per_node: int
    started: float
    offsets: dict[str, int] = field(default_factory=dict)


def task_logs(
    job_dir: Path, job_id: str, files: dict[str, dict[int, str]], every_task: bool = True
) -> dict[int, str]:
    """Tail of each task's stderr (tracebacks; srun and slurmstepd write into task 0's),
    and of task 0's stdout (Slurm: submitit's files; machine=local: logs/), each with the
    ``NCCL WARN`` lines of the task's NCCL log (where the preflight sent NCCL's output).

    ``every_task=False`` reads task 0 only: with the result pickles that settles most
    classes; the other tasks' logs matter to find the node of a collective error.
    """
    if job_id.startswith("local-"):
        logs = {0: tail(JobPaths(job_dir).console_log)}  # the console, then rank 0's own log
        for path in JobPaths(job_dir).logs.glob(RANK_LOG.format(rank="*")):
            rank = int(path.stem.split("_")[1])
            logs[rank] = "\n".join(filter(None, [logs.get(rank, ""), tail(path)]))
    else:
        errs = files[SLURM_STDERR] if every_task else {0: files[SLURM_STDERR].get(0, "")}
        logs = {task: tail(path) for task, path in errs.items() if path}
        if 0 in files[SLURM_STDOUT]:
            logs[0] = tail(files[SLURM_STDOUT][0]) + "\n" + logs.get(0, "")
    for task in logs:
        warned = nccl_warnings(job_dir, task)
        if warned:
            logs[task] += "\n" + warned
    return logs


def nccl_warnings(job_dir: Path, rank: int) -> str:
    """The ``NCCL WARN`` lines at the end of rank ``rank``'s NCCL log ("" without one)."""
    text = tail(JobPaths(job_dir).nccl_log(rank))
    return "\n".join(line for line in text.splitlines() if "NCCL WARN" in line)


def evidence(
    job_dir: Path, record: dict, info: SchedulerInfo | None, every_task: bool = False
) -> Evidence:
    job_id = last_job_id(record)
    state = info.state if info else ""
    expected = int(record.get("nodes", 1)) * int(record.get("tasks_per_node", 1))
    base = failures.base_state(state)
    if base in failures.ACTIVE_STATES:
        return Evidence(state=state, exit_code=info.exit_code if info else "")
    if base == "COMPLETED" and finished_by_itself(job_dir, record):
        return Evidence(state=state, exit_code=info.exit_code if info else "")
    if job_id.startswith("local-"):
        return local_evidence(job_dir, record, expected)
    nodelist = failures.expand_nodelist(info.nodelist if info else "")
    files = slurm_task_files(job_dir, job_id)
    results = read_results(files[SLURM_RESULT])
    succeeded = len(results) == expected and all(outcome == "success" for outcome, _ in results)
    if succeeded and base in ("", "UNKNOWN"):
        return Evidence(state=state, results=results, expected_results=expected)
    return Evidence(
        state=state,
        exit_code=info.exit_code if info else "",
        results=results,
        expected_results=expected,
        logs=task_logs(job_dir, job_id, files, every_task),
        nodes=nodelist,
        tasks_per_node=int(record.get("tasks_per_node", 1)),
        **record_evidence(job_dir, record),
    )


RECORD_CLOCK_SLACK_S = 5.0  # a rank's clock may run behind the launcher's


def attempt_failures(job_dir: Path, record: dict) -> tuple[dict, ...]:
    """The failure records this attempt's ranks left, oldest first (not an earlier
    attempt's in a reused job dir)."""
    since = attempt_start(record) - RECORD_CLOCK_SLACK_S
    return tuple(r for r in read_failures(job_dir) if _record_time(r) >= since)


def _record_time(record: dict) -> float:
    try:
        return float(record.get("time", 0.0))
    except (TypeError, ValueError):
        return 0.0


def record_evidence(job_dir: Path, record: dict) -> dict:
    """``Evidence``'s ``failure_records`` (this attempt's) and ``records``: where a full
    disk leaves its trace when the logs could not be written, the same records as text
    (``os_error``: the errno behind a failed checkpoint save) and the launcher's own
    failed record write (job.json's ``record_error``)."""
    found = attempt_failures(job_dir, record)
    texts = [
        "\n".join([str(r.get("exception", "")), str(r.get("os_error", "")), *r.get("tail", [])])
        for r in found
    ]
    if record.get("record_error"):
        texts.append(str(record["record_error"]))
    return {"records": tuple(texts), "failure_records": found}


def attempt_start(record: dict) -> float:
    """When the launch that job.json records began (0: unknown), so that the failure
    records an earlier attempt left in a reused job dir are not taken for this one's."""
    try:
        return datetime.strptime(str(record.get("submit_time")), "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except (ValueError, OverflowError):
        return 0.0


def local_evidence(job_dir: Path, record: dict, expected: int) -> Evidence:
    """machine=local: the supervisor's record (``submit/supervise.py``), then the logs.

    A job its supervisor stopped on a signal (the user's Ctrl-C or SIGTERM) is cancelled,
    as ``scancel`` is on Slurm. A rank killed by a signal is explained by its own log
    alone: its peers' lost connections are the symptom (what srun's "task N: Killed" line
    tells on Slurm)."""
    job_id = last_job_id(record)
    if local_state(record) == "RUNNING":
        return Evidence(state="RUNNING")
    status = record.get("status")  # a failed one is explained from its logs (diagnose)
    done = status == "completed" or (status != "failed" and finished_by_itself(job_dir, record))
    exit_code = str(record.get("exit_code", ""))
    if done:
        results = tuple(("success", "") for _ in range(expected))
        return Evidence(exit_code=exit_code, results=results)
    ended_by = supervisor_cause(record)
    if ended_by.get("rank") is None and ended_by.get("signal"):
        return Evidence(state=f"CANCELLED by {ended_by['signal']}", exit_code=exit_code)
    logs = task_logs(job_dir, job_id, {})
    for rank, text in failure_tails(job_dir, record).items():  # a waited job's tracebacks
        logs[rank] = "\n".join(filter(None, [logs.get(rank, ""), text]))
    if ended_by.get("signal"):
        logs = {ended_by["rank"]: logs.get(ended_by["rank"], "")}
    return Evidence(exit_code=exit_code, logs=logs, **record_evidence(job_dir, record))


def failure_tails(job_dir: Path, record: dict) -> dict[int, str]:
    """The traceback tail each rank of this attempt recorded as it died (rank -> text): a
    waited local job's rank 0 prints its traceback to the terminal only."""
    return {
        int(r["rank"]): "\n".join(str(line) for line in r.get("tail", []))
        for r in attempt_failures(job_dir, record)
        if isinstance(r.get("rank"), int)
    }


def supervisor_cause(record: dict) -> dict:
    """What ended a local job, as its supervisor saw it: ``rank`` (the rank that failed or was
    killed first), ``signal`` (that killed it, or that stopped the job), ``line``; {} if
    no supervisor said (a job that completed, or a record from before supervisors)."""
    found = record.get("ended_by") if last_job_id(record).startswith("local-") else None
    return found if isinstance(found, dict) else {}


def finished_by_itself(job_dir: Path, record: dict) -> bool:
    """The attempt's own word: rank 0 writes summary.json after the last step (also when
    nobody waited for the job, so job.json may still say "running")."""
    summary = read_summary(job_dir)
    return summary is not None and int(summary.get("steps", 0)) >= int(record.get("steps", 1))


def settled_status(record: dict, info: SchedulerInfo | None, row: JobStatus) -> str | None:
    """What job.json should now say of a job it still calls running or submitted, once the
    end is certain: the job's own results, a dead local process, or sacct's final state.
    A "failed" job whose training had finished is "completed" (what failed came after it)."""
    if record.get("status") == "failed" and row.failure == failures.COMPLETED:
        return "completed"
    if record.get("status") not in ("running", "submitted") or row.failure == failures.RUNNING:
        return None
    if row.failure == failures.COMPLETED:
        return "completed"
    ended = last_job_id(record).startswith("local-") or bool(info and info.state)
    return "failed" if ended else None


def local_state(record: dict) -> str:
    """machine=local: the record's status, checking that a "running" job's process lives:
    ``local-<pid>`` names the job's supervisor (before supervisors: its rank 0)."""
    if record.get("status") != "running":
        return ""
    pid = int(last_job_id(record).split("-", 1)[1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass
    return "RUNNING" if runs_axonn_launch(pid) else ""


def runs_axonn_launch(pid: int) -> bool:
    """Whether process ``pid`` is one of ours, not another that reuses the number (True
    where /proc cannot tell)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return b"axonn_launch" in command


def diagnose(
    job_dir: Path, record: dict, info: SchedulerInfo | None, preflight: dict | None
) -> tuple[str, Diagnosis]:
    """(state to show, diagnosis) of one job; ``preflight``: its verdict (``preflight_of``).

    A job whose training finished (its summary.json has every step) is COMPLETED whatever
    failed after it (a sample, an export: ``after_training`` in the summary says what)."""
    if record.get("status") == "refused":
        return "REFUSED", Diagnosis(failures.UNKNOWN, f"sbatch refused it: {record.get('error')}")
    if not last_job_id(record):
        return "NOT_SUBMITTED", Diagnosis(failures.UNKNOWN, "no job id in job.json")
    ev = evidence(job_dir, record, info)
    diagnosis = failures.classify(ev)
    resized = info and info.lost_nodes and diagnosis.failure != failures.RUNNING
    if resized and not finished_by_itself(job_dir, record):  # whatever Slurm calls the end
        lost = failures.lost_from_allocation(info.lost_nodes, info.state, info.nodelist)
        return info.state or "ENDED", lost
    if diagnosis.failure in (failures.COLLECTIVE_FAILURE, failures.UNKNOWN):
        ev = evidence(job_dir, record, info, every_task=True)
        diagnosis = failures.classify(ev)
    if diagnosis.failure == failures.UNKNOWN:  # no word left: could it write one?
        diagnosis = unwritable_job_dir(job_dir) or diagnosis
    if last_job_id(record).startswith("local-") and diagnosis.bad_nodes:
        diagnosis = replace(diagnosis, bad_nodes=())  # one computer: nothing to leave out
    if diagnosis.failure not in (failures.COMPLETED, failures.RUNNING):
        diagnosis = shown_reason(job_dir, record, diagnosis)
        if finished_by_itself(job_dir, record):  # what failed came after the training
            why = f"training finished, then the job ended ({diagnosis.failure}): {diagnosis.reason}"
            return "COMPLETED", Diagnosis(failures.COMPLETED, why)
    stopped = preflight_stop(preflight, diagnosis)
    shown = ev.state or _state_from_class(diagnosis.failure)
    return shown, stopped or diagnosis


def shown_reason(job_dir: Path, record: dict, diagnosis: Diagnosis) -> Diagnosis:
    """The reason a failed job shows: a storage fault's file system and room; a hang's or a
    non-finite step's own words (where and why, from the rank that diagnosed it); else the
    first failing rank's, or what the supervisor saw (a kill, a stop)."""
    if diagnosis.in_own_words:  # a hang, a non-finite step, an OOM kill: said where it was seen
        return diagnosis
    first = None
    cause = supervisor_cause(record)
    if diagnosis.failure in failures.STORAGE_CLASSES:  # which file system, how much room:
        # it wins over the supervisor's line (``rank 0 ... exited with code 1``), its effect
        return replace(diagnosis, reason=storage_reason(job_dir, diagnosis))
    if not cause.get("signal"):
        first = firstfail.first_failure(job_dir)
    if first is not None:  # the rank that failed first says why, in its own words
        return replace(diagnosis, reason=firstfail.headline(first))
    if cause.get("line"):  # killed or stopped: the supervisor saw it happen
        return replace(diagnosis, reason=str(cause["line"]))
    return diagnosis


# --- storage faults: which file system, how much room ---------------------------------------

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


def preflight_stop(preflight: dict | None, diagnosis: Diagnosis) -> Diagnosis | None:
    """A failed job that its preflight stopped for slow nodes: a node failure of those
    nodes (resume without them), whatever its ranks' PreflightError looks like in the logs."""
    slow = slow_nodes_of(preflight)
    if not slow or not (preflight or {}).get("stopped"):
        return None
    if diagnosis.failure in (failures.COMPLETED, failures.RUNNING):
        return None
    why = preflight.get("slow_reason") or f"slow nodes {', '.join(slow)}"
    reason = f"preflight stopped the job: {why}"
    return Diagnosis(failures.NODE_FAILURE, reason, tuple(slow))


def _state_from_class(failure: str) -> str:
    if failure == failures.COMPLETED:
        return "COMPLETED"
    return "RUNNING" if failure == failures.RUNNING else "ENDED"


def job_status(
    job_dir: Path, record: dict, info: SchedulerInfo | None, preflight: dict | None
) -> JobStatus:
    if is_dry_run(record):  # its own state: no failure class, nothing to do about it
        state, diagnosis = DRY_RUN_STATE, None
    else:
        state, diagnosis = diagnose(job_dir, record, info, preflight)
    metrics = last_metrics(job_dir)
    results = run_results(job_dir, metrics)
    grid = record.get("grid") or {}
    root = run_root(job_dir, record)
    run_now = run_state(root, record if root == Path(job_dir) else None)
    stragglers = stragglers_of(job_dir)
    return JobStatus(
        job_dir=str(job_dir),
        job_id=last_job_id(record),
        name=str(record.get("name", "")),
        machine=str(record.get("machine", "")),
        model=str(record.get("model", "")),
        grid=" ".join(f"{a}={grid[a]}" for a in ("data", "x", "y", "z") if a in grid),
        nodes=int(record.get("nodes", 0)),
        state=state,
        step=int(metrics["step"]) if metrics else None,
        steps=int(record.get("steps", 0)),
        loss=results.loss,
        tokens_per_s=results.tokens_per_s,
        step_time_s=results.step_time_s,
        failure=diagnosis.failure if diagnosis else "",
        action=action_of(diagnosis, record, run_now, preflight, stragglers) if diagnosis else "",
        reason=diagnosis.reason[:300] if diagnosis else "dry run: never submitted",
        attempt=int(record.get("attempt", 1)),
        bad_nodes=list(diagnosis.bad_nodes) if diagnosis else [],
        resubmitted_as=str(record.get("resubmitted_as", "")),
        slow_nodes=slow_nodes_of(preflight),
        after_training=after_training_of(job_dir),
        run_dir=str(root),
        run_state=run_now,
        excluded=[str(n) for n in record.get("excluded_nodes") or []],
        allocation=allocation_of(record, info),
        allocations=allocations_of(record, info),
        restarts_in_place=restarts_of(record),
        charged_nodes=len(slurmtext.expand_nodelist(info.nodelist)) if info else 0,
        detail=dict(diagnosis.detail) if diagnosis else {},
        problems=record_problems(job_dir) + provenance.code_warnings(job_dir, record),
        **stragglers,
    )


CHAIN_ACTS = (RUN_RUNNING, RUN_WAITING, RUN_RECOVERING, RUN_DONE)  # a stopped one no more


def action_of(
    diagnosis: Diagnosis, record: dict, run_now: str, preflight: dict | None, stragglers: dict
) -> str:
    """What is done about the job: while a chain recovers its run, what the chain does
    (submit/recovery.py's ``recover``: the run's policy; a resume leaves out the slow nodes
    of its preflight and, with ``exclude_stragglers``, the stragglers' nodes); otherwise
    what ``jobs resubmit`` does (records/failures.py's RECOVERY holds both)."""
    if run_now not in CHAIN_ACTS or diagnosis.failure not in failures.CHAIN_POLICY:
        return diagnosis.action
    settings = record.get("recovery") if isinstance(record.get("recovery"), dict) else {}
    action = failures.chain_action(diagnosis.failure, settings.get("policy") or {})
    named = [str(s.get("node", "")) for s in stragglers["stragglers"]]
    named = named if settings.get("exclude_stragglers") else []
    new = [n for n in named if NODE_NAME.fullmatch(n) and n not in diagnosis.bad_nodes]
    resumes = action in (failures.RESUME, failures.RESUME_EXCLUDING)
    if resumes and (slow_nodes_of(preflight) or new):
        return failures.RESUME_EXCLUDING
    return failures.excluding_only_named(action, diagnosis.bad_nodes)


def stragglers_of(job_dir: Path) -> dict:
    """``stragglers`` and ``straggler_step`` of the newest straggler report (also while
    the job runs); none without one."""
    report = read_stragglers(job_dir) or {}
    named = [s for s in report.get("stragglers") or [] if isinstance(s, dict)]
    step = report.get("step")
    return {"stragglers": named, "straggler_step": step if isinstance(step, int) else None}


def straggler_line(row: JobStatus) -> str:
    """``stragglers at step 300: rank 3 (n2) 2.4x the median own work, ...`` ("" without)."""
    if not row.stragglers:
        return ""
    named = []
    for found in row.stragglers[:8]:
        ratio = found.get("ratio")
        times = f" {ratio:.1f}x the median own work" if isinstance(ratio, (int, float)) else ""
        named.append(f"rank {found.get('rank')} ({found.get('node', '?')}){times}")
    more = f", {len(row.stragglers) - 8} more" if len(row.stragglers) > 8 else ""
    at = f" at step {row.straggler_step}" if row.straggler_step is not None else ""
    return f"stragglers{at}: {', '.join(named)}{more}"


def allocation_of(record: dict, info: SchedulerInfo | None) -> list[float]:
    """An ended attempt's submit, start and end (unix seconds): sacct's for a Slurm job; a
    local job's launch (it starts at once) and its supervisor's end. Empty until it ended."""
    if info is not None:
        return list(info.times or ())
    if not last_job_id(record).startswith("local-"):  # a refused launch has no job id
        return []
    try:
        start = float(record["submitted_at"])
        end = datetime.strptime(str(record["ended"]), "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except (KeyError, TypeError, ValueError):
        return []
    return [start, start, end] if start <= end else []


def allocations_of(record: dict, info: SchedulerInfo | None) -> list[list[float]]:
    """Every allocation of an ended attempt, oldest first: sacct's (a requeued job's
    earlier ones too, those of this launch only: a job id may have served an older job);
    a local job's one. Empty until it ended. An allocation whose job restarted in place
    counts as one per step: each restart cuts it where it began (``split_at_restarts``)."""
    current = allocation_of(record, info)
    if not current:
        return []
    since = attempt_start(record) - RECORD_CLOCK_SLACK_S
    found = [list(a) for a in (info.allocations if info else ()) if a[0] >= since]
    found = found if current in found else [*found, current]
    return split_at_restarts(found, restarts_of(record))


def restarts_of(record: dict) -> list[float]:
    """When each restart in place of the job began (job.json's ``in_job`` steps)."""
    settings = record.get("in_job")
    steps = settings.get("steps") if isinstance(settings, dict) else None
    return sorted(float(s["started"]) for s in steps or []
                  if isinstance(s, dict) and "started" in s)  # fmt: skip


def split_at_restarts(allocations: list[list[float]], restarts: list[float]) -> list[list[float]]:
    """Each (submit, start, end) cut at the restarts inside it: a restart's part was
    submitted and started when it began (no queue), and ends where the next one begins."""
    cut = []
    for submit, start, end in allocations:
        inside = [t for t in restarts if start < t < end]
        bounds = [start, *inside, end]
        for n, (low, high) in enumerate(zip(bounds, bounds[1:])):
            cut.append([submit if n == 0 else low, low, high])
    return cut


def after_training_of(job_dir: Path) -> dict[str, str]:
    """summary.json's ``after_training``: step -> "done", "failed: ..." or "pending"."""
    found = (read_summary(job_dir) or {}).get("after_training")
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


UNREADABLE_STATE = "UNREADABLE"


def unreadable_row(job_dir: Path, why: str) -> JobStatus:
    """The row of a job dir whose job.json cannot be trusted (``why``: the schema's words):
    listed, never dropped, and nothing is done with it."""
    return JobStatus(
        job_dir=str(job_dir), job_id="", name="", machine="", model="", grid="", nodes=0,
        state=UNREADABLE_STATE, step=None, steps=0, loss=None, tokens_per_s=None,
        step_time_s=None, failure="", action="", reason=f"UNREADABLE {why}", attempt=1,
        run_dir=str(job_dir), problems=[f"UNREADABLE {why}"],
    )  # fmt: skip


def packed_info(record: dict, info: SchedulerInfo | None) -> SchedulerInfo | None:
    """A packed sweep point's own state (``submit/pack.py``): its pack's job runs several
    points, so once the pack started it, the point's state, times and exit status are what
    the pack's run recorded in its job.json; the pack's own while queued, or if the pack
    ended before the point did."""
    point = record.get("pack")
    if not isinstance(point, dict) or "started" not in point:
        return info
    nodes = ",".join(point.get("nodes") or [])
    if "ended" not in point:
        ongoing = info is None or info.times is None
        return SchedulerInfo("RUNNING", "", nodes) if ongoing else info
    code = int(point.get("exit_code", 1))
    start = float(point["started"])
    times = (float(record.get("submitted_at") or start), start, float(point["ended"]))
    state = "COMPLETED" if code == 0 else "FAILED"
    return SchedulerInfo(state, f"{code}:0", nodes, times, (times,))


def collect(paths: list[str], later_attempts: bool = False) -> list[JobStatus]:
    """Status of every job under ``paths``, with one scheduler query for all of them. A job
    dir whose job.json fails its schema is an UNREADABLE row (``unreadable_row``).
    ``later_attempts``: the attempts each found one was resubmitted as come too (they are
    its siblings, not under it), so that a run's root dir shows its newest attempt. A job
    Slurm could not be asked about shows its last known state (``unreachable_status``)."""
    records = [(job_dir, read_one(job_dir)) for job_dir in find_job_dirs(paths)]
    if later_attempts:
        records = with_later_attempts(records)
    view = scheduler_view([last_job_id(r) for _, r in records if isinstance(r, dict)])
    infos = view.infos
    starts = expected_starts([j for j, i in infos.items() if i.state.startswith("PENDING")])
    rows = []
    for job_dir, record in records:
        if isinstance(record, str):
            rows.append(unreadable_row(job_dir, record))
            continue
        info = packed_info(record, infos.get(last_job_id(record)))
        preflight = preflight_of(job_dir, record)  # read once per job
        if view.unreachable and unsettled_slurm_job(job_dir, record, info):
            rows.append(unreachable_status(job_dir, record, preflight, view.unreachable))
            continue
        remember_scheduler_state(job_dir, record, info)
        row = job_status(job_dir, record, info, preflight)
        row.expected_start = starts.get(row.job_id, "")
        settled = settled_status(record, info, row)
        if settled:  # job.json tells the truth from now on
            with contextlib.suppress(OSError, ValueError):
                update_record(job_dir, status=settled, failure=row.failure)
        fold_preflight(job_dir, record, preflight)
        rows.append(row)
    return rows


def read_one(job_dir: Path) -> dict | str:
    """job.json, or why it cannot be trusted (``unreadable_row``'s words)."""
    try:
        return read_record(job_dir)
    except RecordError as error:
        return str(error)
    except OSError as error:  # unreadable (permissions), or gone since the walk
        return f"{RECORD}: {error.strerror or error}"


def with_later_attempts(records: list[tuple[Path, dict | str]]) -> list[tuple[Path, dict | str]]:
    """``records`` and, after them, each attempt one was resubmitted as (``resubmitted_as``,
    followed to the newest) that is not among them yet."""
    found = list(records)
    seen = {str(job_dir.resolve()) for job_dir, _ in found}
    for _, record in found:  # grows while read: an attempt's own later attempt comes too
        later = record.get("resubmitted_as") if isinstance(record, dict) else None
        if not later or str(Path(later).resolve()) in seen:
            continue
        if not JobPaths(later).record.is_file():  # a resubmission under way, or one that died
            continue
        seen.add(str(Path(later).resolve()))
        found.append((Path(later), read_one(Path(later))))
    return found


# --- Slurm unreachable: the last known state, never a verdict --------------------------------

SEEN = "scheduler_seen"  # job.json: the job's last state Slurm gave, and when (unix s)
UNREACHABLE_WORDS = "Slurm unreachable"


def unsettled_slurm_job(job_dir: Path, record: dict, info: SchedulerInfo | None) -> bool:
    """A Slurm job that only Slurm can say has ended: job.json still calls it submitted or
    running, nothing else (a pack's record) gave its state, and it did not finish training."""
    job_id = last_job_id(record)
    if not job_id or job_id.startswith("local-") or info is not None or is_dry_run(record):
        return False
    unsettled = record.get("status") in ("running", "submitted")
    return unsettled and not finished_by_itself(job_dir, record)


def remember_scheduler_state(job_dir: Path, record: dict, info: SchedulerInfo | None) -> None:
    """Keep in job.json the state Slurm just gave a queued or running job, with the time:
    what status shows when Slurm cannot be reached."""
    if info is None or failures.base_state(info.state) not in slurmtext.ACTIVE_STATES:
        return
    if last_job_id(record).startswith("local-") or "pack" in record:
        return
    with contextlib.suppress(OSError, ValueError):
        update_record(job_dir, **{SEEN: {"state": info.state, "at": time.time()}})


def unreachable_status(job_dir: Path, record: dict, preflight: dict | None, why: str) -> JobStatus:
    """The row of a job Slurm could not be asked about: its last known state (``RUNNING?``)
    and its age, its step and loss; no class, no action."""
    seen = record.get(SEEN) if isinstance(record.get(SEEN), dict) else {}
    last = str(seen.get("state") or "")
    row = job_status(job_dir, record, SchedulerInfo("RUNNING"), preflight)  # its step, loss
    if last and isinstance(seen.get("at"), (int, float)):
        said = f"last seen {last} {duration(max(0.0, time.time() - seen['at']))} ago"
    else:
        said = f"not seen by jobs status before; job.json says {record.get('status')}"
    said = f"{UNREACHABLE_WORDS}: {said}; nothing is classed, resubmitted or stopped meanwhile"
    return replace(row, state=f"{last}?" if last else "UNREACHABLE", failure="", action="",
                   reason=said, unreachable=why)  # fmt: skip


def unreachable_line(rows: list[JobStatus]) -> str:
    """The one line saying Slurm could not be asked about some of ``rows`` ('' if not)."""
    cut = [r for r in rows if r.unreachable]
    if not cut:
        return ""
    return (f"{UNREACHABLE_WORDS} ({cut[0].unreachable}): {len(cut)} job(s) show their last"
            " known state (STATE ending in ?) and are not classed, resubmitted or stopped"
            " until Slurm answers")  # fmt: skip


def fold_preflight(job_dir: Path, record: dict, preflight: dict | None) -> None:
    """Copy a preflight verdict that only preflight.json holds into job.json."""
    if preflight is None or record.get("preflight", {}).get("job_id") == preflight["job_id"]:
        return
    summary = {k: v for k, v in preflight.items() if k not in ("ranks", "expected")}
    with contextlib.suppress(OSError, ValueError):
        update_record(job_dir, preflight=summary, slow_nodes=slow_nodes_of(preflight))
