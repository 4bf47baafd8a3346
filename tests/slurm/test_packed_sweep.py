"""A packed sweep (``sweep.pack``, ``submit/pack.py``) on the real local cluster's ``wide``
partition: six points of one node each (x2, seeds 1-6) share one allocation of four nodes,
the last two starting as earlier ones end. One point's rank is killed mid-training: that
point restarts in place on its own node while the others train on undisturbed. Every
point's loss equals the same point run alone (machine=local, the same sweep, trained while
the pack runs). ``sweep.pack=array``: three of those points as one job array, two tasks
at once, launched right after the pack and training beside it. Over 60 s: two waves of
points slowed to 1 s per step (so that the kill lands mid-training), with the array's tasks
and the six local runs beside them.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import read_record
from tests.conftest import run_launcher
from tests.slurm.test_faults import jobs_cli, processes, wait_ended, wait_until
from tests.slurm.test_recovery import final_loss
from tests.slurm.test_restart_in_place import metrics_step, sbatch_logger

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SEEDS = "train.seed=1,2,3,4,5,6"
TRAIN = [
    "grid.x=2", "train.steps=8", "train.sample_tokens=0", "train.checkpoint_every=2",
    "preflight=false", "train.gemm_tuning=false", "force=true",
]  # fmt: skip
# All four nodes: n2 may be DOWN for a while (tests/slurm/test_recovery.py, on another
# worker, takes its own exclusive job's node down); the pack then waits for it
PACKED = ["machine=slurm_local", "machine.slurm.partition=wide", "sweep.pack=4",
          "sweep.pack_time_min=20"]  # fmt: skip
ARRAY = ["machine=slurm_local", "sweep.pack=array", "sweep.array_limit=2"]
SLOW = "slow@step2:1"  # every rank sleeps 1 s in each step from step 2 (the loss is unchanged)


def point_dirs(sweep_dir: Path) -> dict[int, Path]:
    rows = [json.loads(p.read_text()) for p in (sweep_dir / "points").glob("*.json")]
    return {row["num"]: Path(row["job_dir"]) for row in rows}


def point_pids(job_dir: Path) -> list[int]:
    """pids of the Python ranks of the packed point in ``job_dir``."""
    folder = str(job_dir).encode() + b"/"
    return [
        pid
        for pid, argv, _, _ in processes()
        if b"submitit.core._submit" in argv
        and b"python" in argv[0]
        and argv[-2].startswith(folder)  # argv ends with submitit's folder (and b"")
    ]


def ended(job_dir: Path) -> bool:
    return read_record(job_dir).get("status") in ("completed", "failed")


@pytest.fixture(scope="module")
def sweep(slurm_cluster, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("packed")
    shim = sbatch_logger(root / "bin")
    sweep_dir = root / "sweep"
    launched = run_launcher(
        ["-m", *TRAIN, *PACKED, SEEDS, f"hydra.sweep.dir={sweep_dir}"],
        cwd=root, path_prefix=str(shim), env={"AXONN_FAULT": SLOW}, timeout=300,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-2000:]
    in_array = launch_array(root / "array")  # beside the pack (its own jobs, debug partition)
    dirs = point_dirs(sweep_dir)
    victim = dirs[1]
    wait_until(lambda: metrics_step(victim) >= 3, 300, "point 1's step 3 (after checkpoint 2)")
    pids = wait_until(lambda: len(p := point_pids(victim)) == 2 and p, 60, "point 1's ranks")
    os.kill(pids[1], signal.SIGKILL)
    local = root / "local"  # the points run alone, while the pack goes on
    alone = run_launcher(["-m", *TRAIN, "machine=local", SEEDS, f"hydra.sweep.dir={local}"],
                         cwd=root, timeout=600)  # fmt: skip
    assert alone.returncode == 0, alone.stdout[-3000:]
    wait_until(lambda: all(ended(d) for d in dirs.values()), 400, "every point to end")
    (job_id,) = {read_record(d)["job_ids"][0] for d in dirs.values()}
    return {"dir": sweep_dir, "points": dirs, "local": point_dirs(local), "shim": shim,
            "job_id": job_id, "state": wait_ended(job_id, timeout_s=120),
            "console": launched.stdout, "array": in_array}  # fmt: skip


def test_six_points_run_in_one_allocation_of_four_nodes(sweep):
    calls = (sweep["shim"] / "calls.log").read_text().splitlines()
    assert len(calls) == 1 and calls[0].endswith("pack.sh"), calls  # no job per point
    assert sweep["state"] == "COMPLETED"
    assert (
        f"pack 0: job {sweep['job_id']}, 4 nodes x 20 min, points 0,1,2,3,4,5" in sweep["console"]
    )
    starts = sorted(read_record(d)["pack"]["started"] for d in sweep["points"].values())
    first_end = min(read_record(d)["pack"]["ended"] for d in sweep["points"].values())
    assert starts[3] < first_end <= starts[4]  # four at once; the fifth once one has ended


def test_every_point_ends_at_the_loss_of_the_same_point_run_alone(sweep):
    for num, job_dir in sweep["points"].items():
        assert read_record(job_dir)["status"] == "completed", num
        assert final_loss(job_dir) == final_loss(sweep["local"][num]), num


def test_only_the_killed_point_restarted_in_place_on_its_own_node(sweep):
    restarts = {n: read_record(d)["in_job"]["steps"] for n, d in sweep["points"].items()}
    assert [n for n, steps in restarts.items() if steps] == [1], restarts
    (restart,) = restarts[1]
    assert restart["nodes"] == read_record(sweep["points"][1])["pack"]["nodes"]
    (attempt,) = read_record(sweep["points"][1])["chain"]["attempts"]
    assert (attempt["class"], attempt["in_place"]) == ("rank_killed", True), attempt


def test_jobs_status_of_the_sweep_shows_every_point_completed(sweep):
    result = jobs_cli("status", str(sweep["dir"]), "--json", cwd=sweep["dir"].parent)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert sorted(r["failure"] for r in rows) == ["completed"] * 6, rows
    assert {r["job_id"] for r in rows} == {sweep["job_id"]}
    (killed,) = [r for r in rows if r["job_dir"] == str(sweep["points"][1])]
    assert killed["attempts"] == 2, killed
    text = jobs_cli("status", str(sweep["dir"]), cwd=sweep["dir"].parent).stdout
    pack = f"pack 0: job {sweep['job_id']}, 4 nodes x 20 min, points 0,1,2,3,4,5: 6 completed"
    assert pack in text, text


# --- sweep.pack=array: points of one shape as one job array ---------------------------------


def launch_array(root: Path) -> dict:
    """Seeds 1-3 as one job array, two tasks at once, each chained to its recovery job;
    launched by ``sweep`` right after its pack, so that both train at once (the array's
    tasks are one node each on the debug partition, beside the pack's steps: neither is
    exclusive)."""
    root.mkdir()
    shim = sbatch_logger(root / "bin")
    sweep_dir = root / "sweep"
    launched = run_launcher(
        ["-m", *TRAIN, *ARRAY, "train.seed=1,2,3", f"hydra.sweep.dir={sweep_dir}"],
        cwd=root, path_prefix=str(shim), timeout=300,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-2000:]
    return {"dir": sweep_dir, "shim": shim, "console": launched.stdout}


@pytest.fixture(scope="module")
def array(sweep) -> dict:
    """The array ``sweep`` launched, once every task ended; compared with the same points
    run alone (``sweep``'s local runs of seeds 1-6)."""
    launched = sweep["array"]
    dirs = point_dirs(launched["dir"])
    wait_until(lambda: all(ended(d) for d in dirs.values()), 300, "every task to end")
    return {**launched, "points": dirs, "local": sweep["local"]}


def test_a_job_array_runs_each_point_as_its_own_task_at_the_point_s_loss(array):
    calls = (array["shim"] / "calls.log").read_text().splitlines()
    assert len(calls) == 4 and calls[0].endswith("pack.sh"), calls  # the array, 3 recoveries
    job_id = read_record(array["points"][0])["job_ids"][0].split("_")[0]
    for num, job_dir in array["points"].items():
        record = read_record(job_dir)
        assert record["job_ids"] == [f"{job_id}_{num}"] and record["status"] == "completed"
        assert f"--dependency=afterany:{job_id}_{num} " in calls[1 + num], calls
        assert final_loss(job_dir) == final_loss(array["local"][num]), num
    times = sorted((read_record(d)["pack"]["started"], read_record(d)["pack"]["ended"])
                   for d in array["points"].values())  # fmt: skip
    assert times[2][0] >= min(end for _, end in times[:2])  # %2: the third waits for a slot
    assert f"array 0: job {job_id}, 3 tasks of 1 node(s), points 0,1,2" in array["console"]
    text = jobs_cli("status", str(array["dir"]), cwd=array["dir"].parent).stdout
    assert f"array 0: job {job_id}, 3 array tasks, points 0,1,2: 3 completed" in text, text


# --- sweep.pack=auto never asks for more nodes than the partition has ----------------------


def test_auto_packs_fit_the_two_node_default_partition(tmp_path):
    """Four one-node points with ``sweep.pack=auto`` on the default partition (debug, 2
    nodes): packs of at most 2 nodes that Slurm can start (not PartitionNodeLimit, which
    never clears). Cancelled once queued: the packs' runs are the test above's."""
    import re
    import subprocess

    from axonn_launch.scheduler.slurm_queries import held_for_good

    sweep_dir = tmp_path / "sweep"
    args = ["-m", "machine=slurm_local", "sweep.pack=auto", "train.seed=1,2,3,4", *TRAIN,
            f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    result = run_launcher(args, cwd=tmp_path, timeout=300)
    packs = re.findall(r"pack \d+: job (\d+), (\d+) nodes x \d+ min", result.stdout)
    try:
        assert result.returncode == 0, result.stderr[-2000:]
        assert len(packs) == 2 and all(int(nodes) <= 2 for _, nodes in packs), result.stdout
        ids = ",".join(job for job, _ in packs)
        queued = subprocess.run(["squeue", "-h", "-j", ids, "-o", "%i|%T|%r"],
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
        reasons = [line.split("|")[2] for line in queued.splitlines()]
        assert not any(held_for_good(r) for r in reasons), queued
    finally:
        subprocess.run(["scancel", *(job for job, _ in packs)], check=False)
