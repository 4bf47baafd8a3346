"""One job of the Frontier profile's real batch script on the emulated cluster, and its
start-up phases from its own timestamps.

The script is rendered as a rehearsal renders it (``submit/render.py``'s parameters of the
frontier profile at N nodes and 8 tasks per node, then ``submit/rehearse.substitute``: GPU,
Slingshot, account and queue flags for the local ones; the node-local copy of the
interpreter to the emulated nodes' own storage), with one change: each task runs a trivial
command (``date``, a line in its rank log) in place of submitit's Python, so that srun's
fan-out of N x 8 tasks is timed alone. The broadcast (pack, sbcast, unpack on every node)
is the profile's own, from 16 nodes on, of a linked venv (kilobytes) and the package.

Stamps (seconds since the epoch) go to ``<job dir>/stamps``: ``batch_start`` (the
script's first line), one after each set-up line (``pack``, ``sbcast``, ``unpack``),
``srun_start`` (``AXONN_SRUN_START``, exported just before srun) and ``batch_end``; each
task prints its start to its own Slurm log. No torch.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from submitit.slurm.slurm import _make_sbatch_string

from axonn_launch.config.compose import machine_profile
from axonn_launch.submit import rehearse, render

from .cluster import PARTITION, slurm_env

SITE = "frontier"
TASKS_PER_NODE = 8  # Frontier's GCDs per node (conf/machine/frontier.yaml)
NODE_CPUS = 56  # what start.sh declares per frontier node: 8 GPUs x cpus_per_task 7
STAMP = 'echo "{name} $(date +%s.%N)" >> {stamps}'
PHASE_OF = {"sbcast": "sbcast", "--ntasks-per-node=1": "unpack", "tar -C": "pack"}
# an emulated run: 4 steps of 0.5 s, a checkpoint after step 2 and at the end
EMULATED_TRAIN = ["train.steps=4", "train.emulate_step_s=0.5", "train.checkpoint_every=2"]
EMULATED_PHASES = ("rendezvous", "first_step", "first_checkpoint")
IN_JOB_RESTARTS = 2  # a healing run's restarts in place (one is used)


def linked_venv(root: Path) -> Path:
    """A venv whose site-packages entries link to this one's: its copy is kilobytes."""
    if not (root / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                       timeout=120)  # fmt: skip
        ours = Path(sysconfig.get_paths()["purelib"])
        (theirs,) = root.glob("lib/python*/site-packages")
        for entry in ours.iterdir():
            (theirs / entry.name).symlink_to(entry)
    return root


def site_machine(venv: Path):
    """The frontier profile as a rehearsal runs it: this computer's interpreter (the
    linked venv's) and the emulated nodes' local storage (``config/rehearsal.site_config``)."""
    site, local = machine_profile(SITE), machine_profile(rehearse.LOCAL_MACHINE)
    broadcast = replace(site.broadcast, dir=local.broadcast.dir, constraint="")
    return replace(site, python=str(venv / "bin" / "python"), broadcast=broadcast, required=[])


def task_command(job_dir: Path, python: Path | None = None) -> str:
    """What each task runs: its start time to its Slurm log, then a line to its rank log,
    or, given ``python``, the job's rank entry on the job dir (emulated ranks)."""
    if python is not None:
        body = f"date +%s.%N; exec {shlex.quote(str(python))} -m axonn_launch.train"
        return f"sh -c {shlex.quote(body + ' ' + shlex.quote(str(job_dir)))}"
    logs = shlex.quote(str(job_dir / "logs"))
    body = (
        'date +%s.%N; echo "rank $SLURM_PROCID on $SLURMD_NODENAME started"'
        f" > {logs}/rank_$SLURM_PROCID.log"
    )
    return f"sh -c {shlex.quote(body)}"


def emulated_job(job_dir: Path, nodes: int, train: list[str], spares: int = 0) -> None:
    """The job dir of an emulated Frontier run at ``nodes`` nodes (``train.emulate=true``,
    one host task per node, 8 ranks on its threads, the other 7 tasks idle): the launcher's
    dry run writes its spec.json and job.json, as it would for the real job. With
    ``spares``, the job restarts in place on them (``recovery.spare_nodes``)."""
    ranks = nodes * TASKS_PER_NODE
    overrides = [f"machine={SITE}", "model=gpt_tiny", f"nodes={nodes}", f"grid.data={ranks}",
                 f"train.global_batch={ranks}", "train.micro_batch=1", "train.emulate=true",
                 *train, *in_place_overrides(spares), "dry_run=true",
                 f"hydra.run.dir={job_dir}"]  # fmt: skip
    subprocess.run([sys.executable, "-m", "axonn_launch", *overrides], check=True,
                   capture_output=True, timeout=300, cwd=job_dir.parent)  # fmt: skip


def in_place_overrides(spares: int) -> list[str]:
    """Restarts in place on ``spares`` spare nodes (none: the profile's default, which the
    run never uses: it does not fail)."""
    if not spares:
        return []
    return [f"recovery.spare_nodes={spares}", f"recovery.in_job_restarts={IN_JOB_RESTARTS}"]


def stamped(setup: list[str], stamps: str) -> list[str]:
    """The set-up lines with a stamp first and after each broadcast step."""
    lines = [STAMP.format(name="batch_start", stamps=stamps)]
    for line in setup:
        lines.append(line)
        phase = next((p for key, p in PHASE_OF.items() if key in line), None)
        if line.startswith("axonn_setup") and phase:
            lines.append(STAMP.format(name=f"{phase}_done", stamps=stamps))
    lines.append(f'echo "srun_start $AXONN_SRUN_START" >> {stamps}')
    return lines


def batch_script(
    job_dir: Path, nodes: int, venv: Path, emulated: bool = False, spares: int = 0
) -> str:
    """The frontier profile's batch script for ``nodes`` nodes, as rehearsed here; its
    tasks run emulated ranks where ``emulated``, else ``date``. With ``spares``, as the
    launcher submits a job that restarts in place: ``spares`` more nodes, ``--no-kill``
    and the training step in the restart loop (``submit/in_job.py``)."""
    machine = site_machine(venv)
    folder = job_dir / "slurm" / "%j"
    held = nodes + spares
    copy = render.python_copy(machine, nodes=held, python=machine.python, folder=folder)
    params = render.slurm_parameters(machine=machine, nodes=held,
                                     tasks_per_node=TASKS_PER_NODE, job_name="scale",
                                     copy=copy)  # fmt: skip
    local = machine_profile(rehearse.LOCAL_MACHINE)
    local = replace(local, slurm=replace(local.slurm, partition=PARTITION))
    rehearsal = rehearse.Rehearsal(site=SITE, local=local, node_cpus=NODE_CPUS)
    params = rehearse.substitute(params, rehearsal, machine, TASKS_PER_NODE)
    stamps = shlex.quote(str(job_dir / "stamps"))
    params["setup"] = stamped(params["setup"], stamps)
    restarts = None
    if spares:
        params["additional_parameters"] = {**params.get("additional_parameters", {}),
                                           "no-kill": True}  # fmt: skip
        restarts = render.InPlace(python=str(venv / "bin" / "python"), job_dir=str(job_dir),
                                  nodes=nodes, tasks=nodes * TASKS_PER_NODE)  # fmt: skip
    python = venv / "bin" / "python" if emulated else None
    text = _make_sbatch_string(command=task_command(job_dir, python), folder=folder, **params)
    end = STAMP.format(name="batch_end", stamps=stamps)
    return render.as_submitted(text, restarts) + "\n" + end + "\n"


def job_record(job_dir: Path, job_id: str, nodes: int) -> dict:
    """A job.json as the launcher writes one (the fields ``jobs status`` reads)."""
    return {
        "name": f"scale-{SITE}", "job_dir": str(job_dir), "job_ids": [job_id],
        "machine": SITE, "scheduler": "slurm", "model": "gpt_tiny", "nodes": nodes,
        "tasks_per_node": TASKS_PER_NODE, "grid": {"data": nodes * TASKS_PER_NODE},
        "steps": 1, "attempt": 1, "lineage": [], "status": "submitted",
        "command_line": ["axonn_launch", f"machine={SITE}", f"nodes={nodes}", "rehearse=true"],
    }  # fmt: skip


def slurm(args: list[str], check: bool = True) -> str:
    """A Slurm command's output, against the scale instance."""
    proc = subprocess.run(args, capture_output=True, text=True, check=check, timeout=120,
                          env=slurm_env())  # fmt: skip
    return proc.stdout


def submit(
    job_dir: Path,
    nodes: int,
    venv: Path,
    emulated: bool = False,
    spares: int = 0,
    train: list[str] | None = None,
) -> tuple[str, float]:
    """sbatch of the script; the job id and the time just before sbatch ran. An emulated
    job's ``train`` overrides default to ``EMULATED_TRAIN``; one with ``spares`` keeps the
    launcher's own job.json (its dry run's, with the job's id), which the restart reads."""
    if emulated:
        job_dir.parent.mkdir(parents=True, exist_ok=True)
        emulated_job(job_dir, nodes, EMULATED_TRAIN if train is None else train, spares)
    (job_dir / "logs").mkdir(parents=True, exist_ok=True)
    script = job_dir / "scale.sbatch"
    script.write_text(batch_script(job_dir, nodes, venv, emulated, spares))
    submitted = time.time()
    job_id = slurm(["sbatch", "--parsable", str(script)]).strip().split(";")[0]
    (job_dir / "slurm" / job_id).mkdir(parents=True)  # at once, as submitit does
    if spares:
        record = json.loads((job_dir / "job.json").read_text())
        record.update(job_ids=[job_id], status="submitted", dry_run=False, submitted_at=submitted)
    else:
        record = job_record(job_dir, job_id, nodes)
    (job_dir / "job.json").write_text(json.dumps(record, indent=2))
    return job_id, submitted


UNENDED = ("", "PENDING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING")


def wait_ended(job_id: str, timeout: float) -> str:
    """Waits until the job has left the queue and accounting has its end; its sacct state
    (slurmdbd hears of the end after squeue stops listing the job: under load, seconds)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        if not slurm(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False).strip():
            rows = slurm(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"]).splitlines()
            state = rows[-1].strip() if rows else ""  # a job that lost a node: RESIZING first
            if state.split(" ")[0] not in UNENDED:
                return state
        time.sleep(1)
    raise TimeoutError(f"job {job_id} not ended after {timeout:.0f} s (sacct: {state or 'none'})")


def task_starts(job_dir: Path, job_id: str) -> list[float]:
    """Each task's start, from its Slurm log's first line."""
    starts = []
    for path in (job_dir / "slurm" / job_id).glob(f"{job_id}_*_log.out"):
        first = path.read_text().split("\n", 1)[0].strip()
        if first.replace(".", "", 1).isdigit():
            starts.append(float(first))
    return starts


def phases(job_dir: Path, job_id: str, submitted: float) -> dict:
    """The start-up phases in seconds, from the stamps and the tasks' starts."""
    stamps = dict(line.split() for line in (job_dir / "stamps").read_text().splitlines())
    t = {name: float(value) for name, value in stamps.items()}
    starts = sorted(task_starts(job_dir, job_id))
    out = {"sbatch_to_batch_start": t["batch_start"] - submitted}
    if "pack_done" in t:
        out["broadcast_pack"] = t["pack_done"] - t["batch_start"]
        out["broadcast_sbcast"] = t["sbcast_done"] - t["pack_done"]
        out["broadcast_unpack"] = t["unpack_done"] - t["sbcast_done"]
    out["srun_fanout_first_task"] = starts[0] - t["srun_start"]
    out["srun_fanout_median_task"] = statistics.median(starts) - t["srun_start"]
    out["srun_fanout_last_task"] = starts[-1] - t["srun_start"]
    out.update(emulated_phases(job_dir, t["srun_start"]))
    out["srun_to_batch_end"] = t["batch_end"] - t["srun_start"]
    out["sbatch_to_batch_end"] = t["batch_end"] - submitted
    return {"seconds": out, "tasks_started": len(starts)}


def emulated_phases(job_dir: Path, srun_start: float) -> dict[str, float]:
    """From srun's start: the last host's start (Python and the package imported), and the
    last host to reach each phase of ``EMULATED_PHASES`` (its own first rank's); none where
    no rank was emulated."""
    hosts = [json.loads(p.read_text()) for p in (job_dir / "logs" / "emulate").glob("*.json")]
    if not hosts:
        return {}
    out = {"emulated_hosts_started": max(h["started_at"] for h in hosts) - srun_start}
    for name in EMULATED_PHASES:
        reached = [h["started_at"] + h["phases_s"][name] for h in hosts if name in h["phases_s"]]
        if len(reached) == len(hosts):
            out[f"emulated_{name}"] = max(reached) - srun_start
    return out


def timed_command(args: list[str]) -> tuple[float, int, str]:
    """Seconds, exit status and output of ``python -m axonn_launch.jobs ARGS``."""
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "axonn_launch.jobs", *args],
                          capture_output=True, text=True, timeout=600, env=slurm_env(),
                          cwd=os.getcwd())  # fmt: skip
    return time.perf_counter() - began, proc.returncode, proc.stdout + proc.stderr


def batch_tail(job_dir: Path) -> str:
    """The last lines of the batch script's stderr: why a failed point failed."""
    logs = sorted((job_dir / "slurm").glob("*/*_0_log.err"))
    return " | ".join(logs[0].read_text().splitlines()[-3:]) if logs else "none"


def records(job_dir: Path, head: int = 300) -> dict:
    """``jobs status`` and ``jobs logs --failed`` over the job: seconds, exit status and the
    output's first ``head`` characters."""
    out = {}
    for name, args in (("jobs_status", ["status", str(job_dir)]),
                       ("jobs_logs_failed", ["logs", "--failed", str(job_dir)])):  # fmt: skip
        seconds, rc, text = timed_command(args)
        out[name] = {"seconds": seconds, "rc": rc, "output_head": text[:head]}
    return out


def host_words() -> str:
    """This host, as every scale result names it."""
    return f"{platform.node()} {os.cpu_count()} CPUs"


def write_results(out: Path, result: dict, markdown: Callable[[dict], str]) -> None:
    """A bench's results: ``out`` (JSON) and its section beside it (.md)."""
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
