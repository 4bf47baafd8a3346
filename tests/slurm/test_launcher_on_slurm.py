"""The launcher on the real local Slurm cluster: submission, srun across two nodes,
sacct states, sweeps with per-point node counts, and the MPI launch path."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_launcher

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# preflight off: tests/slurm/test_preflight_on_slurm.py and the rehearsals run it
# as test_held_allocation.py's: one local run is both files' reference (``local_run``); the
# sweep below still tunes its GEMMs on Slurm
TRAIN = ["grid.x=2", "grid.z=2", "train.steps=8", "train.sample_tokens=0", "preflight=false",
         "train.gemm_tuning=false"]  # fmt: skip


def sacct(job_id: str) -> dict[str, tuple[str, str]]:
    out = subprocess.run(
        ["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State,NodeList"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    return {r[0]: (r[1], r[2]) for r in rows}


def settled_nodelist(job_id: str) -> str:
    """The job's node list once sacct's record has settled (it can lag the end by ~1 s)."""
    previous = None
    for _ in range(10):
        current = sacct(job_id)[job_id][1]
        if current == previous:
            return current
        previous = current
        time.sleep(1)
    return previous


def wait_for_states(job_ids: list[str], timeout_s: float = 600) -> dict[str, str]:
    """Poll sacct until every job has left PENDING/RUNNING."""
    deadline = time.time() + timeout_s
    while True:
        states = {j: sacct(j).get(j, ("UNKNOWN", ""))[0] for j in job_ids}
        if all(s not in ("PENDING", "RUNNING", "REQUEUED", "UNKNOWN") for s in states.values()):
            return states
        assert time.time() < deadline, f"jobs still running after {timeout_s} s: {states}"
        time.sleep(2)


def final_loss(job_dir: Path) -> float:
    lines = (job_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["loss"]


def submit_sweep(tmp_path: Path) -> dict:
    """A two-point sweep (wait=false): the launcher returns once both jobs are submitted."""
    sweep = tmp_path / "sweep"
    start = time.time()
    result = run_launcher(
        ["-m", "machine=slurm_local", "grid.x=2", "grid.z=1,2", "train.steps=5",
         "train.sample_tokens=0", "preflight=false", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    return {"result": result, "returned_after": time.time() - start, "sweep": sweep}


def submit_mpirun(cluster, tmp_path: Path) -> dict:
    """The job of TRAIN written by a dry run, started with mpirun (Debian's Open MPI +
    mpi4py) inside a two-node allocation of its own."""
    job_dir = tmp_path / "job"
    dry = run_launcher(
        ["machine=slurm_local", *TRAIN, "dry_run=true", f"hydra.run.dir={job_dir}"], cwd=tmp_path
    )
    mpirun = (
        "mpirun --allow-run-as-root --oversubscribe --mca btl self,tcp -np 4 -x PATH "
        "-x OMP_NUM_THREADS=1 "
        f"{sys.executable} -m axonn_launch.train {job_dir}"
    )
    sbatch = ["sbatch", "--parsable", "-N", "2", "--ntasks-per-node=2", "-p", cluster.partition,
              "-o", str(tmp_path / "mpi.out"), "--wrap", mpirun]  # fmt: skip
    submit = subprocess.run(sbatch, capture_output=True, text=True) if dry.returncode == 0 else None
    return {"dry": dry, "submit": submit, "job_dir": job_dir, "out": tmp_path / "mpi.out"}


@pytest.fixture(scope="module")
def early_jobs(slurm_cluster, tmp_path_factory):
    """The sweep's and the mpirun jobs, submitted before the local reference and the
    two-node job: they run beside them (the three tests' 14 tasks fit in the cluster's
    16 CPUs), and their tests read how they ended. Whatever still runs at the end of the
    module is cancelled."""
    jobs = {
        "sweep": submit_sweep(tmp_path_factory.mktemp("sweep")),
        "mpirun": submit_mpirun(slurm_cluster, tmp_path_factory.mktemp("mpirun")),
    }
    yield jobs
    submit = jobs["mpirun"]["submit"]
    records = [json.loads(p.read_text()) for p in jobs["sweep"]["sweep"].glob("*/job.json")]
    ids = [job_id for record in records for job_id in record.get("job_ids", [])]
    ids += [submit.stdout.strip().split(";")[0]] if submit and submit.returncode == 0 else []
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def local_reference(local_run) -> Path:
    return local_run(TRAIN)


def test_two_nodes_complete_and_match_the_local_run(
    slurm_cluster, early_jobs, local_reference, tmp_path
):  # early_jobs first: the sweep and mpirun jobs run while this one does
    # '%x' would be Slurm's job name in --output (unescaped, the job FAILED 0:53): escaped, the
    # logs land in this very dir
    job_dir = tmp_path / "job%x"
    result = run_launcher(
        ["machine=slurm_local", *TRAIN, "wait=true", f"hydra.run.dir={job_dir}"],
        cwd=tmp_path,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((job_dir / "job.json").read_text())
    (job_id,) = record["job_ids"]
    assert record["status"] == "completed" and record["nodes"] == 2
    # sbatch took the recovery job with its escaped --output
    assert record["recovery_job"] and "recovery_error" not in record
    assert sacct(job_id)[job_id][0] == "COMPLETED"
    assert settled_nodelist(job_id) == "n[1-2]"
    assert (job_dir / "submission.sh").read_text() == (
        job_dir / "slurm" / job_id / f"{job_id}_submission.sh"
    ).read_text()
    for rank in range(4):
        assert (job_dir / "slurm" / job_id / f"{job_id}_{rank}_log.out").exists()
    assert "done: 8 steps" in result.stdout + result.stderr  # rank-0 progress was streamed
    assert final_loss(job_dir) == pytest.approx(final_loss(local_reference), rel=1e-6)


def test_sweep_submits_one_job_per_point_with_its_node_count(slurm_cluster, early_jobs):
    sweep, result = early_jobs["sweep"]["sweep"], early_jobs["sweep"]["result"]
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/job.json"))]
    assert sorted(r["nodes"] for r in records) == [1, 2]
    # submitted; or already completed: its recovery job (afterany) settles a success
    assert all(r["status"] in ("submitted", "completed") for r in records), records
    job_ids = [r["job_ids"][0] for r in records]
    states = wait_for_states(job_ids)
    assert set(states.values()) == {"COMPLETED"}, states
    for record in records:
        job_id = record["job_ids"][0]
        nodes = settled_nodelist(job_id)
        expected = {"n[1-2]"} if record["nodes"] == 2 else {"n1", "n2"}
        assert nodes in expected, (record["nodes"], nodes)
    assert "sweep summary:" in result.stdout
    assert early_jobs["sweep"]["returned_after"] < 120  # the sweep did not wait for the jobs


def test_mpirun_launch_reaches_the_same_loss(slurm_cluster, early_jobs, local_reference):
    """The same job started with mpirun (Debian's Open MPI + mpi4py) inside an allocation."""
    mpi = early_jobs["mpirun"]
    assert mpi["dry"].returncode == 0, mpi["dry"].stderr
    assert mpi["submit"].returncode == 0, mpi["submit"].stderr
    job_id = mpi["submit"].stdout.strip().split(";")[0]
    states = wait_for_states([job_id])
    log = mpi["out"].read_text() if mpi["out"].exists() else ""
    assert states[job_id] == "COMPLETED", log[-3000:]
    assert final_loss(mpi["job_dir"]) == pytest.approx(final_loss(local_reference), rel=1e-6)
