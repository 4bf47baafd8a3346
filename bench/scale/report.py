"""scale.json as the "At scale" section of BENCHMARKS.md (bench/results/scale.md)."""

from __future__ import annotations

PHASES = [
    ("cluster_start", "cluster start (start.sh, all nodes idle)"),
    ("sbatch_to_batch_start", "sbatch to batch script start"),
    ("broadcast_pack", "broadcast: pack (batch node)"),
    ("broadcast_sbcast", "broadcast: sbcast to every node"),
    ("broadcast_unpack", "broadcast: unpack, one task per node"),
    ("srun_fanout_median_task", "srun fan-out: median task started"),
    ("srun_fanout_last_task", "srun fan-out: last task started"),
    ("emulated_hosts_started", "emulated ranks: last host started (Python, the package)"),
    ("emulated_rendezvous", "emulated ranks: rendezvous of all N x 8 complete"),
    ("emulated_first_step", "emulated ranks: first step done (last host)"),
    ("emulated_first_checkpoint", "emulated ranks: first checkpoint written (last host)"),
    ("srun_to_batch_end", "srun start to batch script end"),
    ("sbatch_to_batch_end", "sbatch to batch script end"),
    ("jobs_status", "`jobs status` of the job"),
    ("jobs_logs_failed", "`jobs logs --failed` of the job"),
    ("cluster_stop", "cluster stop (stop.sh)"),
]


def value(point: dict, key: str) -> float | None:
    extras = {
        "cluster_start": point["start_s"]["total"],
        "cluster_stop": point["stop_s"]["total"],
        "jobs_status": point["records"]["jobs_status"]["seconds"],
        "jobs_logs_failed": point["records"]["jobs_logs_failed"]["seconds"],
    }
    return point["seconds"].get(key, extras.get(key))


def cell(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:,.1f}"


def ran(points: list[dict]) -> list[dict]:
    return [p for p in points if "error" not in p]


def failures(points: list[dict]) -> list[str]:
    """One line per node count whose job did not run to its end, with why."""
    return [f"- N={p['nodes']} (measured): the cluster started ({p['start_s']['total']:.1f} s,"
            f" {p['slurmd']} slurmd, {p['slurmd_rss_mb']:,.0f} MB), the job failed:"
            f" {p['error'][:400]}" for p in points if "error" in p]  # fmt: skip


def phase_table(result: dict) -> list[str]:
    points, targets, fits = ran(result["points"]), result["targets"], result["fits"]
    head = [f"N={p['nodes']} (measured)" for p in points]
    head += [f"N={n:,} (extrapolated)" for n in targets]
    lines = ["| phase, seconds | " + " | ".join(head) + " | best fit (RMS residual) |",
             "|---" * (len(head) + 2) + "|"]  # fmt: skip
    for key, name in PHASES:
        if all(value(p, key) is None for p in points):
            continue  # a phase of the other kind of run (emulated ranks or `date`)
        measured = [cell(value(p, key)) for p in points]
        fit = fits.get(key)
        extra = [cell(fit["extrapolated_s"][str(n)]) if fit else "–" for n in targets]
        best = f"{fit['best']} ({fit['fits'][fit['best']]['rms_residual_s']:.2f} s)" if fit else "–"
        lines.append(f"| {name} | " + " | ".join(measured + extra) + f" | {best} |")
    return lines


def cluster_table(points: list[dict]) -> list[str]:
    lines = ["| nodes | tasks | slurmd | slurmd RSS, MB (per slurmd) | host MemAvailable up, MB"
             " | tasks started | job state | load avg before/after (1 min) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in ran(points):
        per = p["slurmd_rss_mb"] / max(p["slurmd"], 1)
        lines.append(
            f"| {p['nodes']} | {p['tasks']:,} | {p['slurmd']} | {p['slurmd_rss_mb']:,.0f}"
            f" ({per:.1f}) | {p['available_mb_up']:,} | {p['tasks_started']:,} | {p['state']}"
            f" | {p['load_before'][0]:.1f} / {p['load_after'][0]:.1f} |"
        )
    return lines


EMULATED_TASKS = (
    "with the job's emulated ranks (`train.emulate=true`, docs/scale.md): each node's first"
    " task hosts its 8 ranks on threads (a torch-free host; rank 0's host runs torch's"
    " TCPStore server), the other 7 start Python and end, and every rank runs the real"
    " rendezvous (the store), watchdog, step-boundary agreement, metrics and checkpoint"
    " files of 4 steps of 0.5 s (a checkpoint after step 2); the phases of the emulated"
    " ranks are read from each host's record (logs/emulate), from srun's start. Those"
    " phases fit quadratic here because N x 8 Python starts, and rank 0's torch import"
    " before its store can take a client, share two cores (the load average passed 1,000"
    " at 256 nodes): their extrapolations are this host's, far above a site's"
)
TITLES = {
    False: "# At scale: start-up phases against the node count",
    True: "# At scale: emulated ranks from srun to the first checkpoint, against the node count",
}
DATE_TASKS = "with a trivial task (`date`) per rank so that srun's fan-out is timed alone"


def markdown(result: dict) -> str:
    """The section's text."""
    emulated = result.get("tasks") == "emulated"
    title = TITLES[emulated]
    intro = (
        "Measured on emulated nodes: each node is a slurmd on this 2-core host"
        " (machines/slurm_scale), running the Frontier profile's real batch script as a"
        f" rehearsal renders it, {EMULATED_TASKS if emulated else DATE_TASKS}; the broadcast"
        " sends a linked venv and the package (about 5 MB per"
        " node), not a 1.5 GB environment. Every node shares two cores: a figure here is an"
        " upper bound on the launcher's and Slurm's own work, not a site's time. Extrapolated:"
        " the best of three least-squares fits (linear, N log N, quadratic) over the measured"
        " points, or their mean where the best slope is negative; the fan-out's fits carry this"
        " host's load (N x 8 tasks on 2 cores), so they are upper bounds, not a site's time."
        " No rank fails: `jobs logs --failed` scans the logs and answers 'no rank failed'"
        f" (rc 2). Run {result['when']} on {result['host']}{budget_words(result)}."
    )
    parts = [title, "",
             f"Script: bench/scale/run.py (`{result['command']}`)", "", intro, "",
             *phase_table(result), "", *cluster_table(result["points"]), "",
             *failures(result["points"]), ""]  # fmt: skip
    return "\n".join(parts)


def budget_words(result: dict) -> str:
    """What the time budget left out, if anything."""
    budget, skipped = result.get("budget_s"), result.get("skipped", [])
    if not budget:
        return ""
    left = (f"; left out for the budget: N={', '.join(str(n) for n in skipped)}" if skipped
            else "")  # fmt: skip
    return (
        f"; time budget {budget:,.0f} s (`--budget-s`: each N's time predicted from the"
        f" last one's, scaled by the node count), {result['wall_s']:,.0f} s used{left}"
    )
