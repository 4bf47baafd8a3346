"""A pack's run (``python -m axonn_launch.pack <pack dir>``), the one process of a packed
sweep's allocation (``submit/pack.py``): it runs each point's own batch script as a step of
the allocation on nodes it picks, in the plan's order, starting a point as soon as enough
nodes are free, and records each point's nodes, start, end and exit status in the point's
job.json. A point's script restarts its own step in place after a failure (on its own
nodes: ``AXONN_PACK_NODES``); one point's failure never stops another.

USR2 and TERM to the pack are passed on to every running point's script, which passes them
to its ranks as in a job of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from axonn_launch.common import slurmtext
from axonn_launch.common.jobdir import PACK_PLAN, JobPaths, read_record, update_record
from axonn_launch.submit.allocation import Held, step_environment
from axonn_launch.submit.pack import NODES_VARIABLE, Point

POLL_S = 0.5


@dataclass
class Running:
    point: Point
    nodes: tuple[str, ...]
    process: subprocess.Popen


def run_pack(folder: Path, environ: dict[str, str] | None = None) -> int:
    """Run the pack planned in ``folder``; 0 when every point completed, else 1."""
    environ = dict(os.environ if environ is None else environ)
    job_id = environ.get("SLURM_JOB_ID", "")
    plan = json.loads((folder / PACK_PLAN).read_text())
    if plan.get("array"):
        return run_array_task(plan, environ)
    queue = [Point.of(entry) for entry in plan["points"]]
    free = list(slurmtext.expand_nodelist(environ.get("SLURM_JOB_NODELIST", "")))
    running: list[Running] = []
    failed = 0
    relay = Relay(running)
    with relay:
        while queue or running:
            for ended in [r for r in running if r.process.poll() is not None]:
                running.remove(ended)
                free.extend(ended.nodes)
                failed += finish(ended, job_id)
            for point in [p for p in queue if p.nodes <= len(free)]:
                if point.nodes <= len(free):  # in the plan's order, while nodes are free
                    nodes = tuple(free[: point.nodes])
                    del free[: point.nodes]
                    queue.remove(point)
                    running.append(start(point, nodes, job_id, environ))
            time.sleep(POLL_S)
    print(f"axonn_launch: pack ended: {failed} point(s) failed", file=sys.stderr, flush=True)
    return 1 if failed else 0


def run_array_task(plan: dict, environ: dict[str, str]) -> int:
    """A job array's task (``sweep.pack=array``): its point on all of the task's nodes; the
    point's exit status is the task's. The point's Slurm folder is named by the task's own
    job id (its srun's ``%j``); ``<array id>_<task>``, the id job.json and sacct know it by,
    links to it."""
    task = int(environ["SLURM_ARRAY_TASK_ID"])
    point = Point.of(plan["points"][task])
    job_id = environ["SLURM_JOB_ID"]
    nodes = slurmtext.expand_nodelist(environ.get("SLURM_JOB_NODELIST", ""))
    link_array_task(point, job_id, f"{environ['SLURM_ARRAY_JOB_ID']}_{task}", len(nodes))
    running = start(point, tuple(nodes), job_id, environ)
    with Relay([running]):
        running.process.wait()
    return finish(running, job_id) and running.process.returncode


def link_array_task(point: Point, job_id: str, task_id: str, nodes: int) -> None:
    """Where an array task's files are found by both of its names: srun names its logs by
    the task's own job id (``%j``), submitit its pickles by ``<array id>_<task>``, the id
    job.json and ``jobs status`` know the task by. ``slurm/<array id>_<task>`` links to the
    task's folder, and in it each log links to its name by the array id (dangling until
    srun writes it); the job's pickle is written under both names."""
    from submitit.core.utils import JobPaths as SubmititPaths

    paths = JobPaths(point.job_dir)
    folder, link = paths.slurm_job(job_id), paths.slurm_job(task_id)
    folder.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(job_id)
    for rank in range(nodes * point.tasks_per_node):
        own = SubmititPaths(paths.slurm_job(), job_id=job_id, task_id=rank)
        named = SubmititPaths(paths.slurm_job(), job_id=task_id, task_id=rank)
        for real, alias in ((own.stdout, named.stdout), (own.stderr, named.stderr)):
            if not alias.is_symlink():
                alias.symlink_to(real.name)
    pickle = SubmititPaths(paths.slurm_job(), job_id=task_id, task_id=0).submitted_pickle
    pickle.write_bytes(paths.pack_submission.read_bytes())


def start(point: Point, nodes: tuple[str, ...], job_id: str, environ: dict[str, str]) -> Running:
    """Start ``point``'s batch script on ``nodes``: its job pickled where submitit's tasks
    look for it, its shell's output in its task 0's logs (as in a job of its own)."""
    from submitit.core.utils import JobPaths as SubmititPaths

    paths = JobPaths(point.job_dir)
    submitit = SubmititPaths(paths.slurm_job(), job_id=job_id, task_id=0)
    submitit.submitted_pickle.parent.mkdir(parents=True, exist_ok=True)
    submitit.submitted_pickle.write_bytes(paths.pack_submission.read_bytes())
    held = Held(job_id=job_id, nodes=len(nodes))
    env = step_environment(point.params, held, environ)
    env[NODES_VARIABLE] = ",".join(nodes)
    fields = pack_fields(point, job_id, nodes=list(nodes), started=time.time())
    update_record(point.job_dir, status="running", pack=fields)
    with open(submitit.stdout, "ab") as out, open(submitit.stderr, "ab") as err:
        process = subprocess.Popen(
            ["bash", str(paths.submission)], env=env, stdout=out, stderr=err, cwd=point.job_dir
        )
    print(f"axonn_launch: pack: point {point.num} on {','.join(nodes)}", file=sys.stderr,
          flush=True)  # fmt: skip
    return Running(point, nodes, process)


def finish(ended: Running, job_id: str) -> int:
    """Record how ``ended``'s script ended; 1 if it failed."""
    code = ended.process.returncode
    status = "completed" if code == 0 else "failed"
    fields = pack_fields(ended.point, job_id, ended=time.time(), exit_code=code)
    update_record(ended.point.job_dir, status=status, exit_code=code, pack=fields)
    print(f"axonn_launch: pack: point {ended.point.num} {status} (exit {code})",
          file=sys.stderr, flush=True)  # fmt: skip
    return int(code != 0)


def pack_fields(point: Point, job_id: str, **fields) -> dict:
    """job.json's ``pack`` of the point, with ``fields`` added to what it holds."""
    known = dict(read_record(point.job_dir).get("pack") or {})
    return {**known, "job_id": job_id, **fields}


class Relay:
    """While in use, USR2 and TERM to this process go to every running point's script. A
    TERM goes once: a point's script passes it on with ``scancel --signal=TERM`` to the
    whole job, this process included."""

    SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

    def __init__(self, running: list[Running]) -> None:
        self.running = running
        self.before: dict = {}
        self.terminated = False

    def __enter__(self) -> Relay:
        for signum in self.SIGNALS:
            self.before[signum] = signal.signal(signum, self.forward)
        return self

    def forward(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGTERM:
            if self.terminated:
                return
            self.terminated = True
        for entry in self.running:
            if entry.process.poll() is None:
                entry.process.send_signal(signum)

    def __exit__(self, *_: object) -> None:
        for signum, handler in self.before.items():
            signal.signal(signum, handler)
