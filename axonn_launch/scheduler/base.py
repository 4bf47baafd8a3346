"""What every scheduler answers, and the one registry that turns ``machine.scheduler`` into
its object (as ``common/arch`` does for an architecture).

A scheduler is one object: what kind of run it makes (``queued``, ``on_this_computer``), the
commands it needs, and every question put to it about jobs and nodes (states, expected
starts, cancelling, nodes up). The base class answers as a scheduler that knows nothing
(no states, no nodes); ``slurm.py`` and ``local.py`` are the two built in. A new one is one
module with a subclass and one ``register`` line (docs/architecture.md, "Where to add").
Login-node code: never imports torch.
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass, field

from axonn_launch.common import machine


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


@dataclass(frozen=True)
class SchedulerView:
    """What the scheduler said of the jobs: their states, and why it could not be asked at
    all (``unreachable``: '' when it answered)."""

    infos: dict[str, SchedulerInfo] = field(default_factory=dict)
    unreachable: str = ""


class Scheduler:
    """A scheduler that queues nothing and knows no job: subclasses say what they do."""

    name: str = ""
    # jobs wait in a queue for an allocation of cluster nodes, under a time limit and an
    # account: chained recovery jobs, in-place restarts, spare nodes, packed sweeps, a
    # preflight by default, a code snapshot, wall-clock warnings
    queued: bool = False
    # the ranks are processes of this computer (one node, its cores)
    on_this_computer: bool = False
    # the commands a submission needs on PATH
    commands: tuple[str, ...] = ()

    def run_text(self, command: list[str], world_size: int) -> str:
        """How the ranks of a job that is no batch script start (a dry run prints it)."""
        return (
            f"# {world_size} processes, each with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,"
            f" MASTER_PORT set:\n{shlex.join(command)}"
        )

    def missing_commands(self) -> list[str]:
        """Those of ``commands`` that are not on PATH here."""
        return [name for name in self.commands if shutil.which(name) is None]

    def unavailable(self, machine: str) -> str:
        """Why a job of ``machine`` cannot be submitted from here, in one line ('' if it can)."""
        missing = self.missing_commands()
        return f"machine={machine} needs {', '.join(missing)} on PATH" if missing else ""

    def states(self, job_ids: list[str]) -> SchedulerView:
        """The states of ``job_ids`` (none known here)."""
        return SchedulerView()

    def expected_starts(self, job_ids: list[str]) -> dict[str, str]:
        """For each pending job, when it is expected to start, in words."""
        return {}

    def cancel(self, job_ids: list[str]) -> None:
        """Cancel ``job_ids`` (nothing to cancel here)."""

    def nodes_up(self, partition: str) -> list[str] | None:
        """The nodes of ``partition`` that can run a job now; None when it cannot tell."""
        return None

    def job_nodes(self, job_id: str) -> tuple[str, ...]:
        """The nodes job ``job_id`` holds now (none known here)."""
        return ()

    def down_nodes(self, nodes: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``nodes`` that can run no job now (none known here)."""
        return ()

    def partition_nodes(self, partition: str) -> tuple[str, list[str]] | None:
        """(partition name, its nodes) of ``partition`` (the default one for ''); None when
        it cannot tell."""
        return None


SCHEDULERS: dict[str, Scheduler] = {}


def register(scheduler: Scheduler) -> Scheduler:
    """Make ``scheduler`` the one named ``scheduler.name``."""
    SCHEDULERS[scheduler.name] = scheduler
    if scheduler.name not in machine.SCHEDULERS:  # the profile schema accepts it
        machine.SCHEDULERS.append(scheduler.name)
    return scheduler


def names() -> tuple[str, ...]:
    """The names a machine profile's ``scheduler`` may take."""
    return tuple(sorted(SCHEDULERS))


def named(name: str) -> Scheduler:
    """The scheduler called ``name``; KeyError naming the valid ones otherwise."""
    try:
        return SCHEDULERS[name]
    except KeyError:
        raise KeyError(f"scheduler={name!r}: expected one of {', '.join(names())}") from None


# what a job record written before records named their scheduler ran on
UNNAMED_IN_OLD_RECORDS = "slurm"


def recorded(record: dict) -> Scheduler:
    """The scheduler a job's record (job.json) names."""
    return named(str(record.get("scheduler") or UNNAMED_IN_OLD_RECORDS))


def of(machine: object) -> Scheduler:
    """The scheduler of a machine profile (anything with a ``scheduler`` name)."""
    return named(str(getattr(machine, "scheduler", "")))
