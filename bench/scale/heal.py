"""A node lost mid-run at scale, healed on a spare inside the same Slurm job.

For each N: start N + 1 frontier-shaped nodes on the emulated cluster (``cluster.py``), and
submit the Frontier profile's real batch script as the launcher submits a job that restarts
in place (``job.batch_script`` with a spare: N + 1 nodes, ``--no-kill``, the training step
in the restart loop of ``submit/in_job.py``), its N x 8 tasks the job's emulated ranks
(``train.emulate=true``) on the spec.json and job.json of the launcher's own dry run. Once
the first checkpoint is published, one node of the running step (the middle one: not the
batch host, not rank 0's) is set DOWN with ``scontrol``, as an operator or the node health
check does. Then, with no person in the loop: srun ends the step, the batch script runs
``python -m axonn_launch.restart``, which classifies the failure, leaves the node out and
starts the next step on the spare; the ranks resume from the checkpoint and train to the
end. Timed from the job's own records (job.json's ``in_job`` steps, the chain's attempt,
sacct, each emulated host's phases), then ``jobs status`` and ``jobs logs --failed``.

    python bench/scale/heal.py --nodes 8 32 128   # bench/results/scale_heal.json and .md

Each N runs under /tmp/axonn-slurm.lock, taken per N. No torch here (the job's rank 0
starts torch's TCPStore server). Every figure is measured: emulated nodes and ranks on
this host.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from axonn_launch.common import slurmtext  # noqa: E402
from axonn_launch.common.jobdir import checkpointed_step, read_record  # noqa: E402
from axonn_launch.submit.chain import chain_of  # noqa: E402
from bench.scale import cluster, job  # noqa: E402
from bench.scale.fit import fit_phase  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
COMMAND = "python bench/scale/heal.py --nodes 8 32 128"
SPARES = 1
STEPS = 8
DOWN_AFTER = 2  # the checkpoint step once published, the node goes DOWN
TRAIN = [f"train.steps={STEPS}", "train.emulate_step_s=1.0", f"train.checkpoint_every={DOWN_AFTER}"]
REASON = "heal_bench"


def heal_point(nodes: int, work: Path, venv: Path) -> dict:
    """One healed run at ``nodes`` nodes plus a spare, under the Slurm lock."""
    began = time.monotonic()
    point: dict = {"nodes": nodes, "spares": SPARES, "ranks": nodes * job.TASKS_PER_NODE}
    with cluster.slurm_lock():
        point["start_s"] = cluster.start(nodes + SPARES)
        job_dir, victim = work / f"heal{nodes}", ""
        try:
            job_id, submitted = job.submit(job_dir, nodes, venv, emulated=True, spares=SPARES,
                                           train=TRAIN)  # fmt: skip
            point["job_id"] = job_id
            ran_on = wait_checkpoint(job_dir, job_id, timeout=300 + 4 * nodes)
            victim = ran_on[len(ran_on) // 2]
            down_at = set_down(victim)
            point["state"] = job.wait_ended(job_id, timeout=600 + 8 * nodes)
            point.update(healed(job_dir, job_id, submitted, down_at, victim, ran_on))
            point["decision_parts_s"] = decision_parts(job_dir, job_id, ran_on)
            point["records"] = job.records(job_dir, head=3000)
        except (KeyError, RuntimeError, TimeoutError, OSError, ValueError) as exc:
            point["error"] = f"{type(exc).__name__}: {exc}; batch log: {job.batch_tail(job_dir)}"
        finally:
            if victim:
                job.slurm(["scontrol", "update", f"nodename={victim}", "state=resume"], False)
            point["stop_s"] = cluster.stop()
            cluster.clear_node_local()
    point["wall_s"] = time.monotonic() - began
    return point


def wait_checkpoint(job_dir: Path, job_id: str, timeout: float) -> list[str]:
    """Waits for the first checkpoint; the nodes of the step that runs the ranks."""
    deadline = time.monotonic() + timeout
    while checkpointed_step(job_dir) < DOWN_AFTER:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint at step {DOWN_AFTER} after {timeout:.0f} s")
        if not job.slurm(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False).strip():
            raise RuntimeError(f"job {job_id} ended before its checkpoint at step {DOWN_AFTER}")
        time.sleep(1)
    return step_nodes(job_id)


def step_nodes(job_id: str) -> list[str]:
    """The nodes of the job's newest running step (the training step: the broadcast's
    unpack step, if any, has ended)."""
    lines = job.slurm(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %N"]).split("\n")
    steps = [line.split() for line in lines if line.strip() and ".batch" not in line]
    newest = max(steps, key=lambda s: int(s[0].rsplit(".", 1)[1]))
    return slurmtext.expand_nodelist(newest[1])


def decision_parts(job_dir: Path, job_id: str, ran_on: list[str]) -> dict[str, float]:
    """The restart decision's own work on this job dir, timed again once the job ended (the
    host quiet but for the cluster): the failed step's evidence (a tail of each task's
    log), its classification, and the log offsets of the next step (a stat of each)."""
    from axonn_launch.records import failures
    from axonn_launch.records.evidence import EndedStep, log_sizes, step_evidence

    step = EndedStep(job_id, 1, tuple(ran_on), job.TASKS_PER_NODE, time.time() - 3600)
    began = time.perf_counter()
    evidence = step_evidence(job_dir, step)
    read = time.perf_counter()
    failures.classify(evidence)
    classified = time.perf_counter()
    log_sizes(job_dir, job_id)
    return {"evidence": read - began, "classify": classified - read,
            "log_offsets": time.perf_counter() - classified}  # fmt: skip


def set_down(node: str) -> float:
    """The node DOWN, as an operator sets it; when."""
    at = time.time()
    job.slurm(["scontrol", "update", f"nodename={node}", "state=down", f"reason={REASON}"])
    return at


def sacct_steps(job_id: str) -> list[dict]:
    """The job's srun steps from accounting: id, state, nodes, start and end (epoch s)."""
    out = job.slurm(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State,NodeList,Start,End",
                     "--noconvert"])  # fmt: skip
    steps = []
    for line in out.splitlines():
        step_id, state, nodelist, start, end = line.split("|")
        if "." in step_id and step_id.rsplit(".", 1)[1].isdigit():
            steps.append({"id": step_id, "state": state, "nodes": nodelist,
                          "start": epoch(start), "end": epoch(end)})  # fmt: skip
    return steps


def epoch(stamp: str) -> float | None:
    if not stamp or stamp in ("Unknown", "None"):
        return None
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))


def healed(
    job_dir: Path, job_id: str, submitted: float, down_at: float, victim: str, ran_on: list[str]
) -> dict:
    """What the job's records say of the loss and the heal, and the times between."""
    record = read_record(job_dir)
    restarts = record["in_job"]["steps"]
    attempts = chain_of(job_dir).get("attempts", [])
    summary = json.loads((job_dir / "summary.json").read_text())
    hosts = [json.loads(p.read_text()) for p in (job_dir / "logs" / "emulate").glob("*.json")]
    first_step = max(h["started_at"] + h["phases_s"]["first_step"] for h in hosts)
    rendezvous = max(h["started_at"] + h["phases_s"]["rendezvous"] for h in hosts)
    steps = sacct_steps(job_id)
    failed = [s for s in steps if s["state"] not in ("COMPLETED",) and s["end"]]
    restart = restarts[0] if restarts else {}
    out = {
        "victim": victim,
        "victim_in_next_step": victim in restart.get("nodes", []),
        "spare_in_next_step": bool(set(restart.get("nodes", [])) - set(ran_on)),
        "restarts_in_place": len(restarts),
        "attempts": [
            {
                k: a.get(k)
                for k in (
                    "class",
                    "action",
                    "reason",
                    "bad_nodes",
                    "step",
                    "checkpointed",
                    "restarted",
                )
            }
            for a in attempts
        ],  # fmt: skip
        "summary": {k: summary.get(k) for k in ("steps", "resumed_from", "steps_run", "stopped")},
        "sacct_steps": steps,
        "hosts_after_restart": len(hosts),
        "hosts_on_spare": sum(h.get("node") not in ran_on for h in hosts if "node" in h),
    }
    seconds = {"sbatch_to_down": down_at - submitted}
    if failed:  # sacct's times are whole seconds
        seconds["down_to_step_ended"] = failed[0]["end"] - down_at
    if restart:
        seconds["down_to_restart_decided"] = restart["started"] - down_at
        seconds["restart_to_rendezvous"] = rendezvous - restart["started"]
        seconds["restart_to_first_step"] = first_step - restart["started"]
    seconds["down_to_first_step_again"] = first_step - down_at
    out["seconds"] = seconds
    return out


TITLE = "# At scale: a node lost mid-run, healed on a spare inside the same job"


def markdown(result: dict) -> str:
    """The section for BENCHMARKS.md."""
    lines = [
        TITLE,
        "",
        f"Script: bench/scale/heal.py (`{result['command']}`)",
        "",
        "Measured on emulated nodes and ranks (this host's slurmd, the job's"
        " `train.emulate=true` ranks): the Frontier profile's real batch script as the launcher"
        " submits a job that restarts in place (N + 1 nodes, `--no-kill`, the training step in"
        " the restart loop), on the spec.json and job.json of the launcher's own dry run, with"
        f" `recovery.spare_nodes=1`; the ranks train {STEPS} steps of 1 s with a checkpoint"
        f" every {DOWN_AFTER}. Once step {DOWN_AFTER}'s checkpoint is published, the middle node"
        " of the running step is set DOWN with `scontrol` (as an operator or a health check"
        " does); nothing else is done by hand. Times are from the node's DOWN: the failed"
        " step's end (sacct, whole seconds), the restart decided (`python -m"
        " axonn_launch.restart`: classify, leave the node out, take the spare; the next step's"
        " start in job.json), then from that start the rendezvous of all N x 8 ranks and the"
        " first step, from each emulated host's record. The restart's start-up is the same"
        " emulated start-up as the first one (N host processes starting Python on two cores:"
        ' "At scale: emulated ranks" above), without the broadcast, which every node of the'
        " allocation, the spare too, received at the job's start."
        f" Run {result['when']} on {result['host']}; {result['wall_s']:,.0f} s in all.",
        "",
        "| nodes + spare | ranks | node DOWN after sbatch | step ended | restart decided"
        " | rendezvous again | first step again | job | lost node's ranks moved to |"
        " class → action | `jobs status` s | `jobs logs --failed` s, names |",
        "|---|---:|---:|---|---:|---:|---:|---|---|---|---:|---|",
    ]
    for p in result["points"]:
        if "error" in p:
            lines.append(
                f"| {p['nodes']} + {p['spares']} | {p['ranks']:,} | error: {p['error'][:200]} |"
            )
            continue
        lines.append(row(p))
    lines += [
        "",
        "Step ended: sacct gives whole seconds (its end is floored), so the step ended within"
        " that second of the DOWN. Restart decided, rendezvous and first step: seconds after"
        " the DOWN, then after the restart's start.",
    ]
    if all(healed_as_expected(p) for p in result["points"]):
        lines[-1] += (
            " In every run the next step ran on the"
            " grid's other nodes and the spare, never on the lost node; the ranks resumed from the"
            " checkpoint and ended at the last step; `jobs status` says COMPLETED, 2 attempts in"
            " 1 allocation (1 restarted in place); `jobs logs --failed` names the first rank of the"
            " lost node (from its log's node name and the chain's `bad_nodes`), not a peer that"
            " srun killed."
        )
    fits = fit_table(result["points"])
    return "\n".join([*lines, *([""] + fits if fits else [])]) + "\n"


def decision_s(point: dict) -> float | None:
    parts = point.get("decision_parts_s")
    return sum(parts.values()) if parts else None


FITTED = (  # (name, the phase's seconds in a point)
    ("restart decided, after the DOWN", lambda p: p["seconds"].get("down_to_restart_decided")),
    ("first step again, after the restart", lambda p: p["seconds"].get("restart_to_first_step")),
    ("`jobs status`", lambda p: p["records"]["jobs_status"]["seconds"]),
    ("`jobs logs --failed`", lambda p: p["records"]["jobs_logs_failed"]["seconds"]),
)
TARGETS = [1024, 1536, 4096, 9408]  # as run.py's: the paper's runs, and all of Frontier
NOISE_S = 0.1  # a spread below this is no growth: a command's start varies this much here


def fit_table(points: list[dict]) -> list[str]:
    """Each recovery phase against N: measured, then fitted (``fit.py``) and extrapolated,
    once three node counts ran."""
    ran = sorted((p for p in points if "error" not in p), key=lambda p: p["nodes"])
    if len(ran) < 3:
        return []
    head = [f"N={p['nodes']} (measured)" for p in ran]
    head += [f"N={n:,} (extrapolated)" for n in TARGETS]
    lines = [
        "| phase, seconds | " + " | ".join(head) + " | best fit (RMS residual) |",
        "|---" * (len(head) + 2) + "|",
    ]
    for name, seconds in FITTED:
        ys = [seconds(p) for p in ran]
        if None in ys:
            continue
        spread, mean = max(ys) - min(ys), sum(ys) / len(ys)
        if spread < NOISE_S:  # three points of noise fit any curve: none is claimed
            best = f"none: spread {spread:.2f} s, under {NOISE_S} s; the mean"
            extra = [mean] * len(TARGETS)
        else:
            fit = fit_phase([p["nodes"] for p in ran], ys, TARGETS)
            best = f"{fit['best']} ({fit['fits'][fit['best']]['rms_residual_s']:.2f} s)"
            extra = [fit["extrapolated_s"][str(n)] for n in TARGETS]
        cells = [f"{y:,.1f}" for y in ys] + [f"{x:,.1f}" for x in extra]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {best} |")
    return [
        *lines,
        "",
        "Fitted over three node counts (linear, N log N, quadratic; the mean where the best"
        f" slope is negative, or where the points spread less than {NOISE_S} s, this host's"
        " noise in a command's start): a trend, not a law, and every extrapolated figure is"
        " this host's"
        " (the first step again is the emulated start-up of N host processes on two cores)."
        " The restart decided after the DOWN also holds srun's end of the failed step and the"
        " host's load while N x 8 tasks are killed; the decision's own work, timed again on"
        " the job dir after the job (the failed step's evidence: a tail of each task's log;"
        " its class; the next step's log offsets: a stat of each), grows with the tasks, one"
        " file each" + decision_words(ran) + ".",
    ]


def decision_words(ran: list[dict]) -> str:
    """The decision's own work at the largest point, per task, and linear to 4,096 nodes."""
    timed = [p for p in ran if decision_s(p) is not None]
    if not timed:
        return ""
    largest = max(timed, key=lambda p: p["nodes"])
    seconds, tasks = decision_s(largest), largest["ranks"]
    at = 4096 * job.TASKS_PER_NODE
    return (
        f": {seconds:.3f} s at {tasks:,} tasks ({seconds / tasks * 1e6:.0f} µs a task, measured),"
        f" {seconds / tasks * at:.1f} s at 4,096 nodes' {at:,} (extrapolated, linear)"
    )


def healed_as_expected(p: dict) -> bool:
    """The run healed as the section's last paragraph says."""
    status = p.get("records", {}).get("jobs_status", {}).get("output_head", "")
    return (
        "error" not in p
        and p["state"].startswith("COMPLETED")
        and p["spare_in_next_step"]
        and not p["victim_in_next_step"]
        and p["summary"]["steps"] == STEPS
        and p["summary"]["resumed_from"] == DOWN_AFTER
        and "1 restarted in place" in status
    )


def row(p: dict) -> str:
    s, logs = p["seconds"], p["records"]["jobs_logs_failed"]
    ended = s.get("down_to_step_ended", float("nan"))
    cls = ", ".join(f"{a['class']} → {a['action']}" for a in p["attempts"])
    named = logs["output_head"].split("\n", 1)[0]
    moved = "the spare" if p["spare_in_next_step"] and not p["victim_in_next_step"] else "?"
    end = (
        f"{p['state']}, step {p['summary']['steps']} (resumed from {p['summary']['resumed_from']})"
    )
    return (
        f"| {p['nodes']} + {p['spares']} | {p['ranks']:,} | {s['sbatch_to_down']:.0f} s"
        f" | {ended:+.0f} to {ended + 1:+.0f} s"
        f" | +{s.get('down_to_restart_decided', float('nan')):.1f} s"
        f" | +{s.get('restart_to_rendezvous', float('nan')):.1f} s"
        f" | +{s.get('restart_to_first_step', float('nan')):.1f} s"
        f" | {end} | {moved} ({p['victim']} out) | {cls}"
        f" | {p['records']['jobs_status']['seconds']:.2f}"
        f' | {logs["seconds"]:.2f}, "{named}" |'
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--out", type=Path, default=RESULTS / "scale_heal.json")
    parser.add_argument("--remake", action="store_true",
                        help="run nothing: write the section of --out again")  # fmt: skip
    args = parser.parse_args(argv)
    if args.remake:
        result = json.loads(args.out.read_text())
        args.out.with_suffix(".md").write_text(markdown(result))
        return 0
    work = Path(tempfile.mkdtemp(prefix="axonn-heal-"))
    venv = job.linked_venv(work / "venv")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    points, began = [], time.monotonic()
    for nodes in args.nodes:
        points.append(heal_point(nodes, work, venv))
        write(args.out, points, when, time.monotonic() - began)
        print(json.dumps(points[-1].get("seconds", points[-1].get("error"))), flush=True)
    return 0


def write(out: Path, points: list[dict], when: str, wall_s: float) -> None:
    result = {
        "label": "measured: emulated nodes (slurmd) and emulated ranks on one host",
        "command": COMMAND, "host": job.host_words(), "when": when,
        "wall_s": wall_s, "train": TRAIN, "points": points,
    }  # fmt: skip
    job.write_results(out, result, markdown)


if __name__ == "__main__":
    sys.exit(main())
