"""What Slurm says of jobs: their states from one batched ``sacct`` call (``squeue`` without
accounting), every allocation of a requeued job, the nodes a resize took, and when a pending
job is expected to start (``squeue --start``) or why it never will.

The text is parsed by ``common/slurmtext.py``; the commands run through ``common/command.py``.
Login-node code: never imports torch.
"""

from __future__ import annotations

import re

from axonn_launch.common import slurmtext
from axonn_launch.common.command import command_output, command_result
from axonn_launch.scheduler.base import SchedulerInfo, SchedulerView

# the commands this module runs (``slurm.py`` runs the others)
SACCT, SQUEUE = "sacct", "squeue"


def scheduler_states(job_ids: list[str]) -> dict[str, SchedulerInfo]:
    """State of every Slurm job in ``job_ids``: one sacct call, or squeue without accounting."""
    return scheduler_view(job_ids).infos


def scheduler_view(job_ids: list[str]) -> SchedulerView:
    """The states of the Slurm jobs in ``job_ids``: one sacct call, or squeue without
    accounting; when neither answers, no state at all and why (never an empty queue)."""
    ids = sorted({j for j in job_ids if j and not j.startswith("local-")})
    if not ids:
        return SchedulerView()
    out, sacct_said = command_result([*sacct_command(ids), "--duplicates"])
    if out is not None:
        return SchedulerView(sacct_infos(out))
    queued, squeue_said = command_result(squeue_command())
    if queued is None:
        return SchedulerView({}, f"squeue: {squeue_said}; sacct: {sacct_said}")
    return SchedulerView(squeue_infos(queued, ids))


def sacct_states(job_ids: list[str]) -> dict[str, SchedulerInfo] | None:
    """None when sacct is missing or fails (no accounting). Asked with ``--duplicates``:
    without it sacct shows a requeued job's newest allocation only, and the earlier ones
    (allocated time, maybe hung) would pass for time in the queue."""
    out = command_output([*sacct_command(job_ids), "--duplicates"])
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
    kept = set(slurmtext.expand_nodelist(newest.nodelist))
    lost = [n for r in rows if slurmtext.base_state(r.state) == "RESIZING"
            for n in slurmtext.expand_nodelist(r.nodelist) if n not in kept]  # fmt: skip
    return tuple(dict.fromkeys(lost))


def expected_starts(job_ids: list[str]) -> dict[str, str]:
    """For each pending Slurm job, when Slurm expects it to start and why it waits
    (``squeue --start``: its scheduler's estimate, N/A before one is made); one call."""
    if not job_ids:
        return {}
    command = [SQUEUE, "-h", "--start", "-j", ",".join(sorted(job_ids)), "-o", "%i|%S|%r"]
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
    return squeue_infos(command_output(squeue_command()) or "", job_ids)


def squeue_infos(text: str, job_ids: list[str]) -> dict[str, SchedulerInfo]:
    """The rows of ``squeue`` output ``text`` for ``job_ids``."""
    rows, wanted = slurmtext.parse_squeue(text), set(job_ids)
    return {job: SchedulerInfo(r.state, "", r.nodelist) for job, r in rows.items() if job in wanted}


def sacct_command(job_ids: list[str]) -> list[str]:
    """One sacct call for the allocation line (``-X``) of every job in ``job_ids``."""
    fields = ",".join(slurmtext.SACCT_FIELDS)
    return [SACCT, "-X", "-n", "-P", "-o", fields, "-j", ",".join(job_ids)]


def squeue_command() -> list[str]:
    return [SQUEUE, "-h", "-o", slurmtext.SQUEUE_FORMAT]
