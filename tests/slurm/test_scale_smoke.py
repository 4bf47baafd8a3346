"""The scale smoke test: the emulated cluster's small version (machines/slurm_scale).

16 frontier-shaped nodes started as a second Slurm instance beside the test cluster, the
Frontier profile's real batch script on all 16 (its environment broadcast to every node's
own storage, then srun's fan-out of 16 x 8 tasks), its start-up phases read from its
stamps, ``jobs status`` over its 128 rank logs, and the instance stopped; the test cluster
keeps its controller and its nodes throughout. bench/scale/run.py does the same at 8 to
256 nodes. Needs root (it starts daemons) and the test cluster's munged and slurmdbd.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest

from bench.scale import cluster, job
from bench.scale.fit import MODELS, fit_phase

pytestmark = [pytest.mark.slurm]

NODES = 16
LOCAL_CTLD_PID = Path("/run/axonn-slurm/slurmctld.pid")  # machines/slurm_local/lib.sh


def node_states(env: dict[str, str] | None = None) -> dict[str, str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t %G"], capture_output=True,
                         text=True, check=True, timeout=60, env=env).stdout  # fmt: skip
    return {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines()}


@pytest.fixture(scope="module")
def scale_job(slurm_cluster, tmp_path_factory):
    """One 16-node Frontier job on a fresh 16-node instance, the instance stopped after."""
    if os.geteuid() != 0:
        pytest.skip("machines/slurm_scale/start.sh needs root")
    local_ctld = LOCAL_CTLD_PID.read_text().strip()
    work = tmp_path_factory.mktemp("scale")
    venv = job.linked_venv(work / "venv")
    started = cluster.start(NODES)
    try:
        states = node_states(cluster.slurm_env())
        job_dir = work / "job"
        job_id, submitted = job.submit(job_dir, NODES, venv)
        state = job.wait_ended(job_id, timeout=120)
        copies = sorted(cluster.STATE_DIR.glob("local-frontier*/axonn-*/env/bin/python"))
        status = job.timed_command(["status", str(job_dir)])
        yield {"started": started, "states": states, "job_id": job_id, "state": state,
               "phases": job.phases(job_dir, job_id, submitted), "copies": copies,
               "status": status, "local_ctld": local_ctld}  # fmt: skip
    finally:
        stopped = cluster.stop()
        cluster.clear_node_local()
        assert stopped["total"] < 60, stopped


def test_scale_smoke_every_node_idle_with_the_sites_shape(scale_job):
    """16 nodes named as Frontier's, each idle with 8 GPUs, in the profile's partition."""
    states = scale_job["states"]
    assert sorted(states) == [f"frontier{i:05d}" for i in range(1, NODES + 1)]
    assert set(states.values()) == {"idle gpu:8"}
    assert scale_job["started"]["total"] < 60, scale_job["started"]


def test_scale_smoke_the_frontier_script_fans_out_to_every_task(scale_job):
    """The job completes; every one of its 16 x 8 tasks started; the broadcast left the
    copy on every node; the phases come in the script's order."""
    assert scale_job["state"] == "COMPLETED"
    phases = scale_job["phases"]
    assert phases["tasks_started"] == NODES * job.TASKS_PER_NODE
    assert len(scale_job["copies"]) == NODES
    s = phases["seconds"]
    assert min(s.values()) >= 0, s
    for phase in ("broadcast_pack", "broadcast_sbcast", "broadcast_unpack"):
        assert s[phase] > 0, s
    assert s["srun_fanout_first_task"] <= s["srun_fanout_last_task"] <= s["srun_to_batch_end"]
    parts = s["sbatch_to_batch_start"] + s["broadcast_pack"] + s["broadcast_sbcast"]
    assert parts + s["broadcast_unpack"] <= s["sbatch_to_batch_end"]


def test_scale_smoke_jobs_status_reads_the_scale_job(scale_job):
    """``jobs status`` of the job dir (sacct of the scale instance) names it completed."""
    seconds, rc, _ = scale_job["status"]
    assert rc == 0


def test_scale_smoke_leaves_the_test_cluster_alone(scale_job):
    """The test cluster's controller is the same process, and its nodes are usable."""
    assert LOCAL_CTLD_PID.read_text().strip() == scale_job["local_ctld"]
    local = node_states()
    assert {f"n{i}" for i in range(1, 5)} <= set(local)
    assert not any(name.startswith("frontier") for name in local)
    assert all(state.split()[0] in ("idle", "mix", "alloc") for state in local.values()), local


def test_scale_fit_names_the_shape_that_made_the_points():
    """Points made by each model are fitted best by that model, and extrapolated by it."""
    nodes = [8, 32, 128, 256]
    for name, shape in MODELS.items():
        if name == "constant":
            continue
        seconds = [2.0 + 0.01 * shape(n) for n in nodes]
        fit = fit_phase(nodes, seconds, [4096])
        assert fit["best"] == name
        assert math.isclose(fit["extrapolated_s"]["4096"], 2.0 + 0.01 * shape(4096))
    falling = fit_phase(nodes, [3.0, 2.0, 1.5, 1.5], [4096])
    assert falling["best"] == "constant"
    assert falling["extrapolated_s"]["4096"] == 2.0
