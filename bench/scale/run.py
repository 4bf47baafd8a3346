"""The launcher's start-up phases against the node count, on the emulated cluster.

For each N: start N frontier-shaped nodes (machines/slurm_scale/start.sh, timed), run the
Frontier profile's real batch script on all of them (``job.py``: sbatch to the script's
start, the environment broadcast, srun's fan-out of N x 8 tasks), time ``jobs status``
and ``jobs logs --failed`` over its N x 8 rank logs, stop the cluster (timed). Then fit
each phase against N and extrapolate to the paper's node counts (``fit.py``). Every figure
is labelled: measured (on this host, emulated nodes), or extrapolated.

    python bench/scale/run.py --nodes 8 32 128 256 512  # bench/results/scale.json and .md
    python bench/scale/run.py --refit                     # fit the points of scale.json again

Both also write the package's start-up model from the fits (``startup_model.py``:
axonn_launch/conf/startup.yaml).
    python bench/scale/run.py --emulated --nodes 8 32 128 256 --budget-s 1200
                  # the job's emulated ranks as the tasks: bench/results/scale_emulated.json

``--budget-s``: before each N, the point's time is predicted from the last one's (its
wall time times the ratio of node counts); an N that would end past the budget is left
out, and the section says which.

Each N runs under /tmp/axonn-slurm.lock (do not wrap it in flock: it takes the lock
itself, per N, so other Slurm users interleave). Stops when the host's available memory
is under 6 GiB. No torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.scale import cluster, job, startup_model  # noqa: E402
from bench.scale.fit import fit_phase  # noqa: E402
from bench.scale.report import markdown  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
TARGETS = [1024, 1536, 4096, 9408]  # Perlmutter, Alps, Frontier paper runs; all of Frontier
MIN_AVAILABLE_MB = 6144
COMMAND = "python bench/scale/run.py --nodes 8 32 128 256 512"
EMULATED_COMMAND = "python bench/scale/run.py --emulated --nodes 8 32 128 256 --budget-s 1200"


def one_point(nodes: int, work: Path, venv: Path, emulated: bool = False) -> dict:
    """Start, job, records and stop at ``nodes`` nodes, under the Slurm lock."""
    began = time.monotonic()
    with cluster.slurm_lock():
        load_before = os.getloadavg()
        started = cluster.start(nodes)
        count, slurmd_mb = cluster.slurmd_memory_mb()
        point = {"nodes": nodes, "tasks": nodes * job.TASKS_PER_NODE, "start_s": started,
                 "slurmd": count, "slurmd_rss_mb": slurmd_mb,
                 "available_mb_up": cluster.available_mb()}  # fmt: skip
        try:
            job_dir = work / f"n{nodes}"
            job_id, submitted = job.submit(job_dir, nodes, venv, emulated)
            point["state"] = job.wait_ended(job_id, timeout=300 + nodes * (4 if emulated else 1))
            point.update(job.phases(job_dir, job_id, submitted))
            point["records"] = job.records(job_dir)
        except (KeyError, RuntimeError, TimeoutError, OSError) as exc:
            point["error"] = f"{type(exc).__name__}: {exc}; batch log: {job.batch_tail(job_dir)}"
        finally:
            point["stop_s"] = cluster.stop()
            cluster.clear_node_local()
        point["load_before"], point["load_after"] = load_before, os.getloadavg()
    point["wall_s"] = time.monotonic() - began
    return point


def phase_series(points: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """phase -> (node counts, seconds) over the points that measured it (the broadcast runs
    from 16 nodes on)."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for point in sorted(points, key=lambda p: p["nodes"]):
        if "error" in point:
            continue
        for name, seconds in {**point["seconds"], **flat_extras(point)}.items():
            series.setdefault(name, ([], []))
            series[name][0].append(point["nodes"])
            series[name][1].append(seconds)
    return series


def flat_extras(point: dict) -> dict[str, float]:
    return {
        "cluster_start": point["start_s"]["total"],
        "cluster_stop": point["stop_s"]["total"],
        "jobs_status": point["records"]["jobs_status"]["seconds"],
        "jobs_logs_failed": point["records"]["jobs_logs_failed"]["seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/scale.json, scale_emulated.json with"
                        " --emulated")  # fmt: skip
    parser.add_argument("--emulated", action="store_true",
                        help="tasks run the job's emulated ranks, not date")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=0,
                        help="leave out an N predicted to end past this many seconds")  # fmt: skip
    parser.add_argument("--add", action="store_true",
                        help="keep the points of --out at other node counts")  # fmt: skip
    parser.add_argument("--refit", action="store_true",
                        help="run nothing: fit the points of --out again")  # fmt: skip
    args = parser.parse_args(argv)
    args.out = args.out or RESULTS / ("scale_emulated.json" if args.emulated else "scale.json")
    meta = {"tasks": "emulated" if args.emulated else "date", "budget_s": args.budget_s,
            "command": EMULATED_COMMAND if args.emulated else COMMAND}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="axonn-scale-"))
    venv = job.linked_venv(work / "venv")
    points, when = [], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if (args.add or args.refit) and args.out.exists():
        before = json.loads(args.out.read_text())
        kept, when = before["points"], before["when"] if args.refit else when
        points = [p for p in kept if args.refit or p["nodes"] not in args.nodes]
        if args.refit:  # the run's own words, as it wrote them
            meta = {k: before[k] for k in (*meta, "skipped", "wall_s") if k in before}
    began, last = time.monotonic(), None
    for nodes in args.nodes if not args.refit else []:
        if cluster.available_mb() < MIN_AVAILABLE_MB:
            print(f"stopping before {nodes} nodes: under {MIN_AVAILABLE_MB} MB available")
            break
        if args.budget_s and last and predicted_end(last, nodes, began) > args.budget_s:
            meta.setdefault("skipped", []).append(nodes)
            print(f"leaving out {nodes} nodes: predicted past the {args.budget_s:.0f} s budget")
            continue
        last = one_point(nodes, work, venv, args.emulated)
        points = sorted([*points, last], key=lambda p: p["nodes"])
        write(args.out, points, when, meta | {"wall_s": time.monotonic() - began})
        print(json.dumps(last.get("seconds", last.get("error"))), flush=True)
    write(
        args.out, points, when, meta if args.refit else meta | {"wall_s": time.monotonic() - began}
    )
    if not args.emulated and args.out == RESULTS / "scale.json":  # the model follows its fits
        startup_model.main(["--scale", str(args.out)])
    return 0


def predicted_end(last: dict, nodes: int, began: float) -> float:
    """Seconds from ``began`` at which a point of ``nodes`` nodes would end: its time is the
    last point's, scaled by the node count."""
    return time.monotonic() - began + last["wall_s"] * nodes / last["nodes"]


def write(out: Path, points: list[dict], when: str, meta: dict) -> None:
    """scale.json and its section, fitted over the points that ran."""
    series = phase_series(points)
    fits = {name: fit_phase(ns, ys, TARGETS) for name, (ns, ys) in series.items() if len(ns) >= 3}
    result = {
        "label": "measured: emulated nodes (slurmd) on one host; fits and targets: extrapolated",
        **meta, "host": job.host_words(), "when": when,
        "points": points, "fits": fits, "targets": TARGETS,
    }  # fmt: skip
    job.write_results(out, result, markdown)


if __name__ == "__main__":
    sys.exit(main())
