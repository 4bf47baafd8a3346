"""A sweep's use of the scheduler: one Slurm job per point against packed allocations
(``sweep.pack``) and a job array (``sweep.pack=array``), on the local Slurm cluster's
``wide`` partition (4 nodes).

Each arm runs the same 6-point sweep (gpt_tiny x2 on one node, seeds 1-6, 8 steps) and
waits until every point has ended. Reported: the ``sbatch`` calls (counted by an sbatch on
PATH that logs each call), the Slurm jobs the sweep put in the queue at once (what sites
limit: Frontier's 100 queued jobs per user), the time from the launch to the last point's
end, and whether every point's final loss equals the per-job arm's. On an idle local
cluster the queue costs nothing, so the time says only what packing costs or saves in
start-up; on a site each allocation waits in the queue.

    python bench/bench_pack.py
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from axonn_launch.records.status import collect  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_pack.md"
TRAIN = ["grid.x=2", "train.steps=8", "train.sample_tokens=0", "train.checkpoint_every=2",
         "preflight=false", "train.gemm_tuning=false", "force=true", "train.seed=1,2,3,4,5,6",
         "machine=slurm_local", "machine.slurm.partition=wide"]  # fmt: skip
ARMS = {
    "one job per point": [],
    "packed (sweep.pack=4)": ["sweep.pack=4", "sweep.pack_time_min=20"],
    "job array (sweep.pack=array)": ["sweep.pack=array"],
}


def sbatch_logger(folder: Path) -> Path:
    real = subprocess.run(["which", "sbatch"], capture_output=True, text=True).stdout.strip()
    folder.mkdir(parents=True)
    script = folder / "sbatch"
    script.write_text(f'#!/bin/sh\necho "$*" >> {folder / "calls.log"}\nexec {real} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder


def point_dirs(sweep_dir: Path) -> list[Path]:
    rows = [json.loads(p.read_text()) for p in (sweep_dir / "points").glob("*.json")]
    return [Path(r["job_dir"]) for r in sorted(rows, key=lambda r: r["num"])]


def queued_jobs() -> int:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    return len(out.split())


def run_arm(root: Path, name: str, extra: list[str]) -> dict:
    shim = sbatch_logger(root / "bin")
    sweep_dir = root / "sweep"
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}
    start = time.time()
    subprocess.run([sys.executable, "-m", "axonn_launch", "-m", *TRAIN, *extra,
                    f"hydra.sweep.dir={sweep_dir}"], cwd=root, env=env, check=True,
                   capture_output=True)  # fmt: skip
    queued = queued_jobs()
    dirs = point_dirs(sweep_dir)
    while True:
        rows = collect([str(d) for d in dirs])
        if all(r.failure in ("completed", "failed", "code_error") for r in rows):
            break
        queued = max(queued, queued_jobs())
        time.sleep(1)
    done = time.time()
    time.sleep(3)  # recovery jobs of completed points are cancelled by Slurm
    losses = [json.loads((d / "summary.json").read_text())["final_loss"] for d in dirs]
    calls = (shim / "calls.log").read_text().splitlines()
    return {"arm": name, "sbatch": len(calls), "queued": queued, "time_s": done - start,
            "losses": losses, "states": [r.failure for r in rows]}  # fmt: skip


def main() -> None:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, (name, extra) in enumerate(ARMS.items()):
            root = Path(tmp) / str(n)
            root.mkdir()
            results.append(run_arm(root, name, extra))
            print(results[-1], flush=True)
    reference = results[0]["losses"]
    lines = [
        "| arm | sbatch calls | Slurm jobs queued at once (most) | launch to last point's end |"
        " every point completed | losses equal the per-job arm's |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['arm']} | {r['sbatch']} | {r['queued']} | {r['time_s']:.1f} s |"
            f" {'yes' if set(r['states']) == {'completed'} else r['states']} |"
            f" {'yes' if r['losses'] == reference else 'no'} |"
        )
    head = [
        "## Sweeps: one job per point, packed allocations and a job array",
        "",
        "Command: `python bench/bench_pack.py` (2 min; the local Slurm cluster's `wide`"
        " partition, 4 nodes; a 6-point sweep of gpt_tiny x2 on one node, seeds 1-6, 8 steps;"
        " recovery on, as by default)",
        "",
    ]
    tail = [
        "",
        "Each point of the per-job arm is a job and a chained recovery job; an array task"
        " has its recovery job too, and squeue lists each task; a pack is one job for every"
        " point (a point that has used its restarts in place is resumed by `jobs resubmit`)."
        " On this idle cluster no job waits in a queue, so the times are equal: what packing"
        " saves at a site is the queue wait of every allocation but one, and the per-user"
        " job limit (Frontier: 100 queued).",
    ]
    text = "\n".join([*head, *lines, *tail]) + "\n"
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
