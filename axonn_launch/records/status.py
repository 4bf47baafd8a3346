"""What happened to each job: its state, the step it reached, its loss, and when it failed,
its failure class and the evidence for it (``records/failures.py``, ``records/evidence.py``).

States come from one batched ``sacct`` call for all jobs (``scheduler/slurm_queries.py``);
without accounting, from ``squeue`` for queued jobs and from submitit's result pickles and
the logs for ended ones. A job the preflight stopped counts as a node failure of the slow
nodes it named. Job dirs are found by ``records/jobdirs.py``; one row per run is
``records/runs.py``'s.

Login-node code: never imports torch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from axonn_launch.common import slurmtext
from axonn_launch.common.durations import duration
from axonn_launch.common.jobdir import (
    RECORD_TIME,
    last_job_id,
    last_metrics,
    read_record_or_empty,
    read_summary,
    record_problems,
    run_root,
    update_record,
)
from axonn_launch.records import failures, firstfail, provenance
from axonn_launch.records.evidence import (
    RECORD_CLOCK_SLACK_S,
    attempt_start,
    evidence,
    finished_by_itself,
    supervisor_cause,
)
from axonn_launch.records.failures import Diagnosis
from axonn_launch.records.jobdirs import (
    DRY_RUN_STATE,
    NODE_NAME,
    after_training_of,
    find_job_dirs,
    is_dry_run,
    preflight_of,
    read_one,
    run_results,
    slow_nodes_of,
    stragglers_of,
    with_later_attempts,
)
from axonn_launch.records.storage import storage_reason, unwritable_job_dir
from axonn_launch.scheduler.slurm_queries import SchedulerInfo, expected_starts, scheduler_view


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
    (batch/recovery.py's ``recover``: the run's policy; a resume leaves out the slow nodes
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
        end = local_end(record)
    except (KeyError, TypeError, ValueError):
        return []
    return [start, start, end] if start <= end else []


def local_end(record: dict) -> float:
    """When a local job's supervisor recorded its end: ``ended_at`` (unix seconds); a
    record written before it existed has only ``ended``, whole seconds, which can fall
    before the ranks' last events of that second (their time is then not counted)."""
    if "ended_at" in record:
        return float(record["ended_at"])
    return datetime.strptime(str(record["ended"]), RECORD_TIME).timestamp()


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
