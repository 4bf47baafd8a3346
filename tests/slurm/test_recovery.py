"""Runs that heal themselves, on the real local cluster, with no command typed after the
launch: each attempt's chained recovery job (``submit/chain.py``, ``batch/recovery.py``)
classifies the failure and acts by policy.

All runs are submitted at once by one fixture (``wait=false``) and run side by side; each
test then follows its own run's chain record in the first attempt's ``job.json``.
Faults: ``kill`` (SIGKILL) and ``code`` (a ValueError) from ``AXONN_FAULT``, pinned to an
attempt with ``:attemptA`` where a fault must not repeat. The lost-node run comes last, on
its own: its node n2 stops for real (``node.sh stop``: slurmd and the job's steps killed,
the node silent until Slurm's SlurmdTimeout), which would end the other runs' tasks there.
What was cut from here to save suite time, and what covers it: tests/README.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from axonn_launch.batch.recovery import exclusion, grow_overrides, nodes_up, usable_nodes
from axonn_launch.common.jobdir import JobPaths, checkpointed_step, read_record, skipped_steps
from axonn_launch.submit.chain import DONE, STOPPED, attempts_of, run_state
from tests.conftest import run_launcher
from tests.slurm.conftest import NODE_SCRIPT, node_states
from tests.slurm.test_faults import (
    Job,
    jobs_cli,
    paused_at_step_9,
    rank_pids,
    sacct_state,
    wait_until,
)
from tests.train.tracker_files import as_float32, jsonl_losses, tb_series, wandb_history

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 12
BASE = [
    "machine=slurm_local",
    f"train.steps={STEPS}",
    "train.sample_tokens=0",
    "train.checkpoint_every=2",
    "recovery.backoff_s=1",
    "wait=false",
    "force=true",  # runs that share one config (a fault aside) go side by side
    "preflight=false",  # tests/slurm/test_preflight_on_slurm.py runs it, with its resubmission
    # each attempt would tune its GEMMs afresh, by timings that move with the load, and a
    # pick that differs from the reference run's rounds differently: the final losses are
    # compared exactly
    "train.gemm_tuning=false",
    # the chain is what is tested here: each failure ends its job (restarts in place, which
    # come first by default: tests/slurm/test_restart_in_place.py)
    "recovery.in_job_restarts=0",
]
TWO_NODES = ["grid.x=2", "grid.z=2", "nodes=2"]
STEP_DEADLINE_S = 6  # the watchdog's deadline of a step once start-up is over
# the SIGSTOP run's steps sleep 3 s: under the suite's load a 6 s floor fired on slow steps
# of all ranks before the stop; 15 s does not
STOPPED_FLOOR_S = 15
STOPPED_FLOOR = f"train.watchdog.step_floor_s={STOPPED_FLOOR_S}"
WATCHDOG = [f"train.watchdog.step_floor_s={STEP_DEADLINE_S}", "train.watchdog.step_factor=3",
            "train.watchdog.beat_s=1"]  # fmt: skip
ONE_NODE = ["grid.x=2", "nodes=1"]
RUNS = {
    # name: (AXONN_FAULT, overrides)
    "reference": ("", [*TWO_NODES, "recovery=off"]),
    # each kill comes one step after a checkpoint's step: a step is lost each time
    "healed": (
        "kill@step6:rank1:attempt1,kill@step10:rank1:attempt2",
        [*TWO_NODES, "metrics.sinks=[jsonl,tensorboard,wandb]"],
    ),
    "code": ("code@step3", ONE_NODE),
    "repeats": ("kill@step3:rank1", [*ONE_NODE, "recovery.max_same_class=2"]),
    "queued": ("", [*ONE_NODE, "+machine.slurm.extra_sbatch.begin=now+3600"]),
    # a fault that does not announce itself (a stopped rank). Each step sleeps 3 s from
    # step 2 in the first attempt, so that the test can stop rank 3 (on n2) with SIGSTOP
    # mid-training; resumed on the same nodes (policy resume) to compare the loss exactly
    "hang_stopped": (
        "slow@step2:3:attempt1",
        [*TWO_NODES, *WATCHDOG[1:], STOPPED_FLOOR, "recovery.policy.hang=resume"],
    ),
    # rank 3 sleeps in step 8 outside any collective; the default policy leaves n2 out
    "hang_fault": ("hang@step8:rank3:attempt1", [*TWO_NODES, *WATCHDOG]),
    # no hang: rank 3 (n2) burns 0.4 s of CPU per step from step 1 (a straggler), then rank
    # 1 (n1) is killed, a class whose policy resumes on the same nodes; exclude_stragglers
    # alone leaves n2 out
    "straggler": (
        "straggle@step1:rank3:400:attempt1,kill@step7:rank1:attempt1",
        [*TWO_NODES, "train.stragglers.every=2", "recovery.exclude_stragglers=true"],
    ),
    "nan_stop": ("nan_grad@step5:rank1", ONE_NODE),
    "nan_rollback": (
        "nan_loss@step5:rank0:attempt1",
        [*ONE_NODE, "recovery.policy.non_finite=rollback"],
    ),
    # killed before its first checkpoint in every attempt: never any progress
    "no_progress": (
        "kill@step1:rank1",
        [*ONE_NODE, "recovery.max_no_progress=2", "recovery.max_same_class=5"],
    ),
}


def launch(name: str, root: Path) -> Path:
    fault, overrides = RUNS[name]
    job_dir = root / name
    result = run_launcher(
        [*BASE, *overrides, f"hydra.run.dir={job_dir}"],
        cwd=root,
        env={"AXONN_FAULT": fault, "WANDB_MODE": "offline"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return job_dir


@pytest.fixture(scope="module")
def runs(slurm_cluster, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recovery")
    return {name: launch(name, root) for name in RUNS}


def ended(root: Path, timeout_s: float = 900) -> str:
    return wait_until(
        lambda: (state := run_state(root)) in (DONE, STOPPED) and state, timeout_s, f"{root}"
    )


def final_loss(job_dir: Path) -> float:
    return json.loads(JobPaths(job_dir).summary.read_text())["final_loss"]


def reference_loss(root: Path) -> float:
    job_id = read_record(root)["job_ids"][0]
    wait_until(lambda: sacct_state(job_id)[0] == "COMPLETED", 900, "the reference run")
    return final_loss(root)


def chain(root: Path) -> dict:
    return read_record(root)["chain"]


def no_job_left(root: Path) -> bool:
    """Nothing of the run is queued or running: attempts and recovery jobs all ended."""
    ids = []
    for attempt in attempts_of(root):
        record = read_record(attempt)
        ids += [str(i) for i in record.get("job_ids", [])] + [str(record.get("recovery_job"))]
    states = [sacct_state(i)[0] for i in ids if i and i != "None"]
    return all(s.split(" ")[0] not in ("PENDING", "RUNNING", "REQUEUED", "") for s in states)


def test_a_stopped_rank_is_a_hang_named_with_its_node_and_the_run_resumes_exactly(runs):
    """Rank 3 (on n2) of an x=2 z=2 run on two nodes gets a real SIGSTOP mid-training.
    The other ranks' watchdogs fire after the step deadline (the 15 s floor: 3x the 3 s
    steps is less) plus a few beats, name rank 3 and n2, dump their stacks, and the job
    ends; the chain resumes on the same nodes and ends at the uninterrupted run's loss.
    The goodput counts the whole stall, at least the deadline, as lost. Over 60 s: two
    attempts and a recovery job. First in the module, while the run is still in its slow
    steps."""
    root = runs["hang_stopped"]
    job_id = read_record(root)["job_ids"][0]
    wait_until(lambda: len(metrics_rows(root)) >= 3, 300, "step 3 of the first attempt")
    pid = wait_until(lambda: rank_pids(job_id).get(3), 60, "rank 3's process")
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    assert ended(root) == DONE
    record = hang_record(root)
    assert record["stalled_s"] >= record["deadline_s"] >= STOPPED_FLOOR_S, record
    # the job itself ended (sacct's End, whole seconds), not only the record: within the
    # deadline and a minute (the answers, the ranks' exit, srun's)
    job_end = sacct_time(str(job_id), "End")
    assert record["time"] <= job_end + 1, (record, job_end)
    assert job_end - stopped_at <= record["deadline_s"] + 60, (record, job_end, stopped_at)
    assert [(s["rank"], s["node"]) for s in record["suspects"]] == [(3, "n2")], record
    stacks = JobPaths(root).stacks
    assert {p.name for p in stacks.glob("rank_*.txt")} >= {"rank_0.txt", "rank_1.txt"}
    assert "Thread" in (stacks / "rank_0.txt").read_text()
    (failed,) = chain(root)["attempts"]
    assert (failed["class"], failed["action"]) == ("hang", "resume")
    shown = jobs_cli("status", "--attempts", str(root), cwd=root.parent).stdout
    assert "hang" in shown and "rank 3" in shown and "n2" in shown and str(stacks) in shown
    attempts = attempts_of(root)
    assert final_loss(attempts[-1]) == reference_loss(runs["reference"])
    wait_until(lambda: no_job_left(root), 120, "the run's jobs to end in sacct")
    (run,) = json.loads(jobs_cli("status", str(root), str(attempts[-1]), "--json",
                                 cwd=root.parent).stdout)  # fmt: skip
    found = run["goodput"]
    # the stall, from the hung section's start to the job's end, is lost, not useful (the
    # allocation's end is sacct's whole second: up to 1 s before the record's time)
    assert found["stalled_s"] >= record["stalled_s"] - 1, (found, record)
    assert found["lost_s"] >= found["stalled_s"] >= STOPPED_FLOOR_S - 1, found


def test_two_faults_in_a_row_are_healed(runs):
    """Over 60 s: three attempts and two recovery jobs, one after another."""
    root = runs["healed"]
    assert ended(root) == DONE
    attempts = attempts_of(root)
    assert len(attempts) == 3, attempts
    history = chain(root)["attempts"]
    assert [a["class"] for a in history] == ["rank_killed", "rank_killed"]
    assert [a["action"] for a in history] == ["resume", "resume"]
    assert final_loss(attempts[-1]) == reference_loss(runs["reference"])
    wait_until(lambda: no_job_left(root), 120, "the last recovery job to be cancelled")
    one_row = json.loads(jobs_cli("status", str(root.parent), "--json", cwd=root.parent).stdout)
    (run,) = [r for r in one_row if r["run_dir"] == str(root)]
    assert (run["job_dir"], run["run_state"], run["attempts"]) == (str(attempts[-1]), DONE, 3)
    chain_rows = jobs_cli("status", str(root.parent), "--json", "--attempts", cwd=root.parent)
    mine = [r for r in json.loads(chain_rows.stdout) if r["run_dir"] == str(root)]
    assert sorted(r["attempt"] for r in mine) == [1, 2, 3]
    assert [r["failure"] for r in sorted(mine, key=lambda r: r["attempt"])] == [
        "rank_killed",
        "rank_killed",
        "completed",
    ]
    check_goodput(run["goodput"], attempts, lost_steps=2)
    shown = jobs_cli("status", str(root.parent), cwd=root.parent).stdout
    assert "GOODPUT" in shown and f"goodput {run['goodput']['goodput']:.0%}" in shown, shown
    report = subprocess.run(
        [sys.executable, "-m", "axonn_launch.report", str(attempts[-1]), "--out", str(root / "r")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    text = (root / "r" / "report.md").read_text()
    assert "## Goodput" in text and f"goodput {run['goodput']['goodput']:.0%}" in text
    check_curves_and_failed_logs(root, attempts)


def check_curves_and_failed_logs(root: Path, attempts: list[Path]) -> None:
    """The three attempts' curves are one series in the root's folders: TensorBoard reads
    steps 1..12 once, with the last attempt's values (its metrics.jsonl holds the earlier
    attempts' rows up to each checkpoint); W&B offline has one run id and every step once.
    ``jobs logs --failed`` of each killed attempt prints rank 1's log (its task's output)."""
    losses = jsonl_losses(attempts[-1])
    assert tb_series(root / "tensorboard", "loss") == [
        (step, as_float32(losses[step])) for step in range(1, STEPS + 1)
    ]
    starts = [0] + [checkpointed_step(a) for a in attempts[:-1]]  # each resumed the last's
    shown = tb_series(root / "tensorboard", "attempt")
    assert shown == [(start + 1, float(n)) for n, start in enumerate(starts, 1)], (shown, starts)
    run_id = json.loads((root / "tracker.json").read_text())["wandb_id"]
    folders = sorted((root / "wandb").glob("offline-run-*"))
    assert folders and all(f.name.endswith(f"-{run_id}") for f in folders), folders
    rows = [row for folder in folders for row in wandb_history(folder)]
    assert sorted(row["_step"] for row in rows) == list(range(1, STEPS + 1)), rows
    assert {row["_step"]: row["loss"] for row in rows} == losses
    for attempt, step in zip(attempts[:2], (6, 10)):
        failed = jobs_cli("logs", str(attempt), "--failed", cwd=root.parent)
        assert failed.stdout.startswith("rank 1 failed first\n"), failed.stdout + failed.stderr
        assert f"injecting kill after step {step} on rank 1" in failed.stdout


def check_goodput(found: dict, attempts: list[Path], lost_steps: int) -> None:
    """The parts add up to the allocated time that sacct gives, within 5%."""
    allocated = 0
    for attempt in attempts:
        job_id = str(read_record(attempt)["job_ids"][-1])
        allocated += int(sacct_field(job_id, "ElapsedRaw"))
    parts = ("useful", "lost", "startup", "checkpoint", "recovery")
    named = sum(found[f"{p}_s"] for p in parts)
    assert abs(named - allocated) <= 0.05 * allocated, (found, allocated)
    assert found["lost_steps"] == lost_steps and (found["lost_s"] > 0) == (lost_steps > 0)
    assert all(found[f"{p}_s"] > 0 for p in parts if p != "lost"), found
    assert len(found["ttr_s"]) == len(attempts) - 1
    assert 0 < found["goodput"] < 1


def sacct_time(job_id: str, name: str) -> float:
    """sacct's ``Start`` or ``End`` of a job, in unix seconds (the local clock)."""
    return datetime.fromisoformat(sacct_field(job_id, name)).timestamp()


def sacct_field(job_id: str, name: str) -> str:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", name, "-j", job_id],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return out.strip().splitlines()[-1]


def test_a_code_error_is_not_retried(runs):
    root = runs["code"]
    assert ended(root) == STOPPED
    stop = chain(root)["stop"]
    assert stop["class"] == "code_error" and "policy stop" in stop["reason"]
    assert attempts_of(root) == [root]  # one attempt only
    status = jobs_cli("status", str(root), cwd=root.parent)
    assert "ValueError" in status.stdout, status.stdout  # the failing rank's exception


def test_a_repeating_fault_stops_at_the_class_cap(runs):
    root = runs["repeats"]
    assert ended(root) == STOPPED
    stop = chain(root)["stop"]
    assert stop["reason"] == "recovery.max_same_class=2: rank_killed 2 times in a row"
    assert len(attempts_of(root)) == 2


def test_jobs_stop_ends_a_queued_chain(runs):
    root = runs["queued"]
    record = read_record(root)
    job_id, recovery_job = record["job_ids"][0], record["recovery_job"]
    assert sacct_state(job_id)[0] == "PENDING"
    result = jobs_cli("stop", str(root), cwd=root.parent)
    assert result.returncode == 0, result.stderr
    assert f"cancelled {job_id} {recovery_job}" in result.stdout
    wait_until(lambda: no_job_left(root), 60, "the chain's jobs to end")
    assert sacct_state(job_id)[0].startswith("CANCELLED")
    assert run_state(root) == STOPPED
    time.sleep(5)  # a recovery step would have resubmitted by now
    assert attempts_of(root) == [root]
    names = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout
    assert "queued" not in names


def test_an_excluded_node_back_in_service_is_used_again(slurm_cluster, tmp_path):
    """n2, left out by an earlier attempt, is up again: only this failure's n1 is left out.
    A node sinfo does not show as up stays out."""
    line = ["axonn_launch", "machine=slurm_local", "+machine.slurm.extra_sbatch.exclude=n2"]
    record = {"command_line": line, "partition": slurm_cluster.partition, "scheduler": "slurm"}
    assert "n2" in usable_nodes(slurm_cluster.partition)
    assert exclusion(tmp_path, record, ["n1"], nodes_up(record)) == (
        ["n1"],
        ["+machine.slurm.extra_sbatch.exclude=n1"],
    )
    record["command_line"] = [*line[:2], "+machine.slurm.extra_sbatch.exclude='n2,n9'"]
    assert exclusion(tmp_path, record, ["n1"], nodes_up(record)) == (
        ["n1", "n9"],
        ["+machine.slurm.extra_sbatch.exclude=n1,n9"],
    )
    record["command_line"] = [*line[:2], "+machine.slurm.extra_sbatch.exclude=n9"]
    assert exclusion(tmp_path, record, ["n1"], nodes_up(record)) == (
        ["n1", "n9"],
        [],
    )  # carried over as is


def test_a_shrunk_run_grows_again_when_its_nodes_are_back(slurm_cluster):
    """An attempt on 1 node of a run that asked for 2: both nodes are up, so the next
    attempt asks for 2 again (the planner's grid); with n2 left out, it stays at 1."""
    assert {"n1", "n2"} <= set(usable_nodes(slurm_cluster.partition))
    shrunk = {"nodes": 1, "partition": slurm_cluster.partition, "scheduler": "slurm"}
    assert grow_overrides(shrunk, {"nodes": 2}, [], nodes_up(shrunk)) == ["nodes=2", "grid=auto"]
    assert grow_overrides(shrunk, {"nodes": 2}, ["n2"], nodes_up(shrunk)) == []
    assert grow_overrides({**shrunk, "nodes": 2}, {"nodes": 2}, [], nodes_up(shrunk)) == []


def test_a_lost_node_is_left_out_and_the_grid_shrinks(runs):
    """n2 stops mid-training (x=2 z=2 on 2 nodes): ``node.sh stop`` kills its slurmd and
    the job's processes there, so the node stops answering, as a crashed node does, and
    Slurm alone finds it out (SlurmdTimeout: DOWN and not responding, the job NODE_FAIL).
    The run comes back on n1 alone with a replanned grid, from the same checkpoint
    resharded, and finishes by itself; then n2 starts again. Over 60 s: the pause, Slurm's
    timeout, the recovery job and the new attempt."""
    for other in ("healed", "hang_stopped", "hang_fault", "straggler"):  # nothing else of
        assert ended(runs[other]) in (DONE, STOPPED)  # this module runs on n2 now
    job_dir = runs["reference"].parent / "lost_node"
    result = run_launcher(  # exclusive: no job of another test file is on n2 when it stops
        [*BASE, *TWO_NODES, "+machine.slurm.exclusive=true", f"hydra.run.dir={job_dir}"],
        cwd=job_dir.parent,
        env={"AXONN_FAULT": "pause@step9:600:attempt1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    first = Job("lost_node", job_dir, read_record(job_dir)["job_ids"][0])
    assert "#SBATCH --no-requeue" in (job_dir / "submission.sh").read_text()
    wait_until(lambda: paused_at_step_9(first), 300, "the run to pause after step 9")
    subprocess.run(["bash", str(NODE_SCRIPT), "stop", "n2"], check=True, timeout=60)
    try:
        # nobody told Slurm: it sees n2 silent (down*, "Not responding") after SlurmdTimeout
        wait_until(lambda: node_states().get("n2") == "down*", 120, "Slurm to find n2 silent")
        assert ended(job_dir) == DONE
    finally:
        subprocess.run(["bash", str(NODE_SCRIPT), "start", "n2"], check=True, timeout=120)
        wait_until(lambda: "n2" in (usable_nodes("") or []), 120, "n2 back in service")
    assert sacct_state(first.job_id)[0] == "NODE_FAIL"
    (failed,) = chain(job_dir)["attempts"]
    assert (failed["class"], failed["action"]) == ("node_failure", "resume_exclude")
    last = attempts_of(job_dir)[-1]
    record = read_record(last)
    assert record["nodes"] == 1 and record["excluded_nodes"] == ["n2"], record
    assert sacct_state(record["job_ids"][-1])[1] == "n1"
    world = 1
    for axis in ("data", "x", "y", "z"):
        world *= int(record["grid"][axis])
    assert world == 2, record["grid"]  # the one node's two tasks
    summary = json.loads(JobPaths(last).summary.read_text())
    assert summary["resumed_from"] == 8
    assert summary["final_loss"] == pytest.approx(reference_loss(runs["reference"]), rel=1e-4)
    wait_until(lambda: no_job_left(job_dir), 120, "the run's jobs to end in sacct")
    (run,) = [r for r in json.loads(jobs_cli("status", str(job_dir), str(last), "--json",
                                             cwd=job_dir.parent).stdout)]  # fmt: skip
    check_goodput(run["goodput"], [job_dir, last], lost_steps=0)  # paused before step 9's end


# --- faults that do not announce themselves: hangs, stragglers, non-finite steps, no progress


def metrics_rows(job_dir: Path) -> list[dict]:
    path = JobPaths(job_dir).metrics
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def failure_records(job_dir: Path) -> list[dict]:
    folder = JobPaths(job_dir).failures
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank_*.json"))]


def hang_record(job_dir: Path) -> dict:
    (record, *_) = [r for r in failure_records(job_dir) if r.get("failure_class") == "hang"]
    return record


def test_a_hang_outside_a_collective_names_its_section_and_its_node_is_left_out(runs):
    """Rank 3 sleeps in step 8 outside any collective. The watchdog names it in section
    compute; the next attempt leaves n2 out (the hang's node) and finishes on n1 with a
    replanned grid, so its loss is compared to a tolerance, as a lost node's is. Over 60 s:
    two attempts and a recovery job."""
    root = runs["hang_fault"]
    assert ended(root) == DONE
    record = hang_record(root)
    assert [(s["rank"], s["node"], s["section"], s["step"]) for s in record["suspects"]] == [
        (3, "n2", "compute", 8)
    ], record
    (failed,) = chain(root)["attempts"]
    assert (failed["class"], failed["action"]) == ("hang", "resume_exclude")
    shown = jobs_cli("status", "--attempts", str(root), cwd=root.parent).stdout
    assert "hang" in shown and "compute" in shown and "rank 3 (n2)" in shown, shown
    last = attempts_of(root)[-1]
    assert read_record(last)["excluded_nodes"] == ["n2"]
    summary = json.loads(JobPaths(last).summary.read_text())
    assert summary["final_loss"] == pytest.approx(reference_loss(runs["reference"]), rel=1e-4)


def test_a_straggler_alone_is_named_by_rank_and_node_and_left_out(runs):
    """No hang: rank 3 (n2) burns CPU in each step and is named within three exchanges
    (every 2 steps) by rank and node, in metrics.jsonl and by ``jobs status``; then rank 1
    (n1) is killed. A killed rank resumes on the same nodes (the healed run's attempts);
    here ``recovery.exclude_stragglers`` alone leaves n2 out, and the run finishes on n1.
    Over 60 s: two attempts and a recovery job."""
    root = runs["straggler"]
    assert ended(root) == DONE
    named = [(row["step"], s) for row in metrics_rows(root) for s in row.get("stragglers", [])]
    assert named and named[0][0] <= 6, named
    assert {(s["rank"], s["node"]) for _, s in named} == {(3, "n2")}, named
    assert named[0][1]["ratio"] > 1.5
    assert not [r for r in failure_records(root) if r.get("failure_class") == "hang"]
    (failed,) = chain(root)["attempts"]
    assert (failed["class"], failed["action"]) == ("rank_killed", "resume_exclude"), failed
    shown = jobs_cli("status", "--attempts", str(root), cwd=root.parent).stdout
    assert "rank 3 (n2)" in shown and "straggler" in shown.lower(), shown
    last = attempts_of(root)[-1]
    record = read_record(last)
    assert record["excluded_nodes"] == ["n2"] and record["nodes"] == 1, record
    assert sacct_state(str(record["job_ids"][-1]))[1] == "n1"
    summary = json.loads(JobPaths(last).summary.read_text())
    assert summary["final_loss"] == pytest.approx(reference_loss(runs["reference"]), rel=1e-4)


def test_a_non_finite_step_stops_the_run_before_it_is_applied_or_saved(runs):
    root = runs["nan_stop"]
    assert ended(root) == STOPPED
    assert attempts_of(root) == [root]  # nothing retried
    stop = chain(root)["stop"]
    assert stop["class"] == "non_finite", stop
    (record, *_) = [r for r in failure_records(root) if r.get("failure_class") == "non_finite"]
    assert (record["step"], record["first"]) == (5, "gradients")
    # step 4's save is asynchronous; the ranks wait for it before they stop
    assert checkpointed_step(root) == 4
    saved = sorted(p.name for p in JobPaths(root).checkpoints.glob("step_*"))
    assert saved and all(int(name.split("_")[1]) < 5 for name in saved), saved
    assert max(row["step"] for row in metrics_rows(root)) == 4
    shown = jobs_cli("status", str(root), cwd=root.parent).stdout
    assert "non_finite" in shown and "step 5" in shown and "gradients" in shown, shown


def test_a_rollback_skips_the_batch_that_made_the_step_non_finite(runs):
    root = runs["nan_rollback"]
    assert ended(root) == DONE
    (failed,) = chain(root)["attempts"]
    assert (failed["class"], failed["action"]) == ("non_finite", "rollback")
    last = attempts_of(root)[-1]
    summary = json.loads(JobPaths(last).summary.read_text())
    assert summary["resumed_from"] == 4 and summary["steps"] == STEPS
    assert skipped_steps(last) == [5]
    assert "skipping the batch" in (JobPaths(last).rank_log(0)).read_text()


def test_a_chain_that_makes_no_progress_stops(runs):
    root = runs["no_progress"]
    assert ended(root) == STOPPED
    stop = chain(root)["stop"]
    assert "recovery.max_no_progress=2" in stop["reason"], stop
    assert "\n" not in stop["reason"] and len(attempts_of(root)) == 2
