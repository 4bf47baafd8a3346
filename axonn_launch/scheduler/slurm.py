"""Slurm as a scheduler object: every Slurm command the launcher runs, and what it makes of
the answer. Submission goes through submitit (``slurm_jobs.py``, which also follows a job);
job states from ``sacct``/``squeue`` are read in ``slurm_queries.py``; the text rules (host
lists, states) are ``common/slurmtext.py``'s, shared with the job side.

Login-node code, and the job's own small calls (``scontrol update ... Requeue=``): no torch.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import axonn_launch.scheduler.slurm_queries as slurm_queries
from axonn_launch.common import slurmtext
from axonn_launch.common.command import command_output
from axonn_launch.scheduler.base import Scheduler, SchedulerView, register

SBATCH, SRUN, SQUEUE, SINFO, SCONTROL, SCANCEL = (
    "sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel",
)  # fmt: skip
SUBMITTED_ID = re.compile(r"(\d+)(?:;\S*)?\s*$")  # sbatch --parsable: <id>[;<cluster>]


class Slurm(Scheduler):
    """Jobs queued with sbatch (through submitit), each in an allocation of cluster nodes."""

    name = "slurm"
    queued = True
    commands = (SBATCH, SRUN)  # submitit's executor looks for srun; sbatch submits

    def unavailable(self, machine: str) -> str:
        missing = self.missing_commands()
        if not missing:
            return ""
        return (
            f"machine={machine} submits to Slurm, but {' and '.join(missing)}"
            f" {'is' if len(missing) == 1 else 'are'} not on PATH (no Slurm here): dry_run=true"
            " shows its batch script without submitting, machine=local trains on this"
            " computer, and rehearse=true runs a site's script on the local Slurm cluster"
            " (machines/slurm_local/start.sh)"
        )

    # --- jobs ------------------------------------------------------------------------------
    def states(self, job_ids: list[str]) -> SchedulerView:
        return slurm_queries.scheduler_view(job_ids)

    def expected_starts(self, job_ids: list[str]) -> dict[str, str]:
        return slurm_queries.expected_starts(job_ids)

    def queued_states(self, job_ids: list[str]) -> dict[str, slurm_queries.SchedulerInfo]:
        """squeue's rows for ``job_ids``: queued and running jobs only."""
        return slurm_queries.squeue_states(job_ids)

    def submit_script(self, script: Path, *options: str) -> tuple[str, str]:
        """``sbatch --parsable [options] script``: (its job id, '') or ('', sbatch's last line)."""
        done = subprocess.run([SBATCH, "--parsable", *options, str(script)],
                              capture_output=True, text=True, check=False)  # fmt: skip
        found = SUBMITTED_ID.search(done.stdout)
        if done.returncode == 0 and found:
            return found.group(1), ""
        return "", (done.stderr.strip().splitlines() or [f"{SBATCH} failed"])[-1]

    def cancel(self, job_ids: list[str]) -> None:
        if job_ids:
            subprocess.run([SCANCEL, *job_ids], capture_output=True, check=False)

    def owners(self) -> tuple[dict[str, tuple[str, str]] | None, str]:
        """Each queued or running job's (name, stdout pattern) by id, and ''; or (None, why
        squeue could not tell)."""
        command = [SQUEUE, "-h", "-O", slurmtext.SQUEUE_OWNER_FORMAT]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            return None, f"{SQUEUE}: {error}"
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            return None, f"{SQUEUE}: {said}"
        return slurmtext.parse_squeue_owners(done.stdout), ""

    def set_requeueable(self, job_id: str, requeueable: bool) -> str:
        """Let Slurm requeue job ``job_id`` or not; '' or the failed command and why."""
        command = [SCONTROL, "update", f"JobId={job_id}", f"Requeue={int(requeueable)}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{' '.join(command)}: {exc}"
        return f"{' '.join(command)}: {done.stderr.strip()}" if done.returncode else ""

    # --- nodes and partitions ----------------------------------------------------------------
    def nodes_up(self, partition: str) -> list[str] | None:
        command = [SINFO, "-h", "-N", "-o", "%N|%t"] + (["-p", partition] if partition else [])
        text = command_output(command)
        if text is None:
            return None
        up = [name for name, state in node_rows(text) if not slurmtext.node_down(state)]
        return list(dict.fromkeys(up))

    def job_nodes(self, job_id: str) -> tuple[str, ...]:
        text = command_output([SQUEUE, "-h", "-j", job_id, "-o", "%N"]) or ""
        return slurmtext.expand_nodelist(text.strip())

    def down_nodes(self, nodes: tuple[str, ...]) -> tuple[str, ...]:
        if not nodes:
            return ()
        text = command_output([SINFO, "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%t"]) or ""
        return tuple(name for name, state in node_rows(text) if slurmtext.node_down(state))

    def partition_nodes(self, partition: str) -> tuple[str, list[str]] | None:
        """(partition name, its nodes) from one ``sinfo`` call: ``partition`` (a comma list
        is their union) or, when empty, the default one (sinfo marks it ``*``); None when
        sinfo is missing, fails or does not list it."""
        return parse_partition_nodes(command_output([SINFO, "-h", "-o", "%P|%N"]), partition)

    def partition_text(self, name: str) -> str:
        """``scontrol show partition -o [name]``'s text ('' when Slurm does not say)."""
        command = [SCONTROL, "show", "partition", "-o", *([name] if name else [])]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout if done.returncode == 0 else ""

    def cluster(self) -> tuple[str, str]:
        """(``scontrol show config``, ``sinfo -N -o '%N %c'``) of the running cluster; raises
        OSError or subprocess.SubprocessError when it does not answer."""
        return _checked([SCONTROL, "show", "config"]), _checked([SINFO, "-h", "-N", "-o", "%N %c"])


def _checked(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, timeout=20, check=True).stdout


def node_rows(text: str) -> list[tuple[str, str]]:
    """``sinfo -N -o '%N|%t'`` as (node, state) rows."""
    rows = (line.strip().partition("|") for line in text.splitlines())
    return [(name, state) for name, _, state in rows if name]


def parse_partition_nodes(text: str | None, partition: str) -> tuple[str, list[str]] | None:
    """``sinfo -h -o '%P|%N'`` text as (partition names, their nodes); see ``partition_nodes``."""
    wanted = {p for p in partition.split(",") if p}
    names, nodes = [], []
    for line in (text or "").splitlines():
        name, sep, hostlist = line.strip().partition("|")
        if sep and (name.rstrip("*") in wanted if wanted else name.endswith("*")):
            names.append(name.rstrip("*"))
            try:
                nodes += slurmtext.expand_nodelist(hostlist)
            except ValueError:
                return None
    return (",".join(dict.fromkeys(names)), list(dict.fromkeys(nodes))) if names else None


SLURM = register(Slurm())
