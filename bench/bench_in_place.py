"""Time to recovery: restarts in place on a spare node against the chain's new jobs, on
the same two faults, on the local Slurm cluster's ``wide`` partition.

Each arm trains gpt_tiny x2 z2 on two nodes for 16 steps (1 s each from step 2, a
checkpoint every 2) and meets the same faults, caused for real: a rank killed with
SIGKILL after step 5, then, in the attempt that follows, one of its nodes set DOWN with
scontrol after step 9. ``chain``: ``recovery.in_job_restarts=0``, so each failure ends
its job and the chained recovery job submits the next attempt (leaving the DOWN node
out). ``in_place``: one spare node (``recovery.spare_nodes=1``), so both failures are
healed inside the first job. Reported from the launcher's own accounting (``jobs status``'s
goodput): each time to recovery (the failed attempt's end to the next one's first step),
goodput, attempts, Slurm jobs, and the final loss against the uninterrupted run.

    python bench/bench_in_place.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from axonn_launch.common.jobdir import JobPaths, read_record, read_record_or_empty  # noqa: E402
from axonn_launch.records.runs import runs  # noqa: E402
from axonn_launch.records.status import collect  # noqa: E402
from axonn_launch.submit.chain import DONE, STOPPED, attempts_of, run_state  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_in_place.md"
TRAIN = ["grid.x=2", "grid.z=2", "train.steps=16", "train.sample_tokens=0",
         "train.checkpoint_every=2", "preflight=false", "train.gemm_tuning=false",
         "force=true"]  # fmt: skip
SLURM = ["machine=slurm_local", "nodes=2", "machine.slurm.partition=wide", "wait=false",
         "+machine.slurm.extra_sbatch.exclude=n1", "recovery.backoff_s=1"]  # fmt: skip
ARMS = {"chain": ["recovery.in_job_restarts=0"], "in_place": ["recovery.spare_nodes=1"]}
SLOW = "slow@step2:1"


def launch(root: Path, name: str, extra: list[str], env: dict | None = None) -> Path:
    job_dir = root / name
    subprocess.run([sys.executable, "-m", "axonn_launch", *TRAIN, *extra,
                    f"hydra.run.dir={job_dir}"], cwd=root, env={**os.environ, **(env or {})},
                   check=True, capture_output=True)  # fmt: skip
    return job_dir


def current(root: Path) -> tuple[Path, str]:
    """The run's newest attempt dir and its Slurm job ('' before it has one)."""
    newest = attempts_of(root)[-1]
    ids = read_record_or_empty(newest).get("job_ids") or [""]
    return newest, str(ids[-1])


def metrics_step(job_dir: Path) -> int:
    path = JobPaths(job_dir).metrics
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return max((r["step"] for r in rows), default=0)


def rank_pid(job_id: str, rank: int) -> int | None:
    """The pid of task ``rank``'s Python of Slurm job ``job_id``, from /proc."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            env = dict(v.split(b"=", 1) for v in (entry / "environ").read_bytes().split(b"\0")
                       if b"=" in v)  # fmt: skip
        except (OSError, ValueError):
            continue
        if (b"submitit.core._submit" in argv and b"python" in argv[0]
                and env.get(b"SLURM_JOB_ID") == job_id.encode()
                and env.get(b"SLURM_PROCID") == str(rank).encode()):  # fmt: skip
            return int(entry.name)
    return None


def wait(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while not (value := predicate()):
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return value


def faults(root: Path) -> None:
    """SIGKILL rank 1 after step 5; then, in the next attempt (a new step or a new job),
    set a node of it other than the batch host DOWN after step 9."""
    job_dir, job_id = wait(lambda: (c := current(root))[1] and c, 120, "a job")
    wait(lambda: metrics_step(job_dir) >= 5, 300, "step 5")
    os.kill(wait(lambda: rank_pid(job_id, 1), 60, "rank 1"), signal.SIGKILL)
    first = (job_dir, job_id, len(read_record(job_dir).get("in_job", {}).get("steps", [])))

    def moved_on() -> tuple[Path, str] | None:
        job_dir, job_id = current(root)
        new = job_id and (job_id != first[1] or restarts(job_dir) > first[2])
        return (job_dir, job_id) if new else None

    job_dir, job_id = wait(moved_on, 300, "the next attempt")
    wait(lambda: metrics_step(job_dir) >= 9 and job_running(job_id), 300, "step 9")
    nodes = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    only_ours = [n for n in expand(nodes) if n in ("n3", "n4")]  # nodes no other job uses
    assert only_ours, f"job {job_id} runs on {nodes}: no node of the wide partition's own"
    victim = only_ours[0]
    subprocess.run(["scontrol", "update", f"nodename={victim}", "state=down",
                    "reason=bench_in_place"], check=True)  # fmt: skip
    print(f"{root.name}: killed rank 1 of job {first[1]}, then set {victim} DOWN", flush=True)


def queued(root: Path) -> list[str]:
    """The run's Slurm jobs (attempts and recovery jobs) still in the queue."""
    ids = []
    for attempt in attempts_of(root):
        record = read_record_or_empty(attempt)
        ids += [str(i) for i in record.get("job_ids", [])]
        ids += [str(record["recovery_job"])] if record.get("recovery_job") else []
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    return [i for i in out.split() if i in ids]


def restarts(job_dir: Path) -> int:
    return len(read_record_or_empty(job_dir).get("in_job", {}).get("steps", []))


def job_running(job_id: str) -> bool:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                          text=True).stdout.strip() == "RUNNING"  # fmt: skip


def expand(nodelist: str) -> list[str]:
    from axonn_launch.common.slurmtext import expand_nodelist

    return list(expand_nodelist(nodelist))


def measure(root: Path) -> dict:
    attempts = attempts_of(root)
    (row,) = runs(collect([str(a) for a in attempts]))
    jobs = [str(i) for a in attempts for i in read_record(a).get("job_ids", [])]
    summary = JobPaths(attempts[-1]).summary
    loss = json.loads(summary.read_text())["final_loss"] if summary.exists() else None
    return {"attempts": row.attempts, "jobs": len(jobs), "goodput": row.goodput, "loss": loss,
            "state": run_state(root)}  # fmt: skip


def main() -> None:
    started = time.time()
    root = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR", "/tmp")))
    print(f"runs in {root}", flush=True)
    results = {}
    for name, extra in ARMS.items():  # one after the other: each alone on the cluster
        run = launch(root, name, [*SLURM, *extra], {"AXONN_FAULT": SLOW})
        try:
            faults(run)
            wait(lambda r=run: run_state(r) in (DONE, STOPPED), 900, f"{name} to end")
        finally:
            for node in ("n2", "n3", "n4"):
                subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"],
                               capture_output=True)  # fmt: skip
        wait(lambda r=run: not queued(r), 300, "the run's jobs to end")  # sacct's end times
        results[name] = measure(run)
    reference = launch(root, "reference", ["machine=local"])
    expected = json.loads(JobPaths(reference).summary.read_text())["final_loss"]
    write_results(results, expected, time.time() - started)


def write_results(results: dict, expected: float, wall_s: float) -> None:
    lines = [
        "## Time to recovery: restarts in place against the chain",
        "",
        f"Command: `python bench/bench_in_place.py` ({wall_s / 60:.0f} min; the local Slurm"
        " cluster's `wide` partition; gpt_tiny x2 z2 on 2 nodes, 16 steps of about 1 s, a"
        " checkpoint every 2; the same two faults in each arm: rank 1 SIGKILLed after step 5,"
        " then a node set DOWN after step 9 of the next attempt)",
        "",
        "| arm | times to recovery | goodput | attempts | Slurm jobs | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ttr = ", ".join(f"{t:.1f} s" for t in r["goodput"].get("ttr_s", [])) or "-"
        good = r["goodput"].get("goodput")
        loss = "equal" if r["loss"] == expected else f"{r['loss']} (differs)"
        lines.append(f"| {name} | {ttr} | {f'{good:.1%}' if good else '-'} | {r['attempts']}"
                     f" | {r['jobs']} | {loss} |")  # fmt: skip
    lines += [
        "",
        f"Uninterrupted run's final loss (machine=local): {expected:.6f}. The chain's Slurm"
        " jobs do not count its recovery jobs; on an idle cluster its new jobs start at once,"
        " so the gap here is the recovery job and a new job's start, not a queue wait,"
        " which at a site is added to every one of the chain's recoveries.",
        "",
    ]
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
