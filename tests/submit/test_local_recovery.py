"""Local runs that heal themselves: with ``recovery=on`` a machine=local job's supervisor
(``batch/supervise.py``) runs the recovery step itself when its attempt fails, and the
next attempt gets a detached supervisor of its own, so the run needs nobody logged in.
Real 2-rank gloo jobs of gpt_tiny through the launcher, faults from ``AXONN_FAULT``;
``recovery.backoff_s=0`` so that nothing waits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from axonn_launch.common.jobdir import checkpointed_step, read_record, read_summary
from axonn_launch.records.goodput import PARTS
from axonn_launch.submit import chain
from tests.cli_server import run_module
from tests.conftest import run_launcher
from tests.submit.test_local_supervisor import poll, rank_pids_under, reap  # noqa: F401 (a fixture)
from tests.train.tracker_files import as_float32, jsonl_losses, tb_series, wandb_history

SMALL = ["machine=local", "model=gpt_tiny", "grid.x=2", "train.steps=8",
         "train.checkpoint_every=2", "train.warmup_steps=0", "train.sample_tokens=0",
         "train.progress=false", "train.gemm_tuning=false"]  # fmt: skip
RECOVERY_ON = ["recovery=on", "recovery.backoff_s=0"]
EVERY_SINK = "metrics.sinks=[jsonl,tensorboard,wandb]"
RUN_ENDS_S = 300
REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap")]  # ends what a failure leaves


def ended(root: Path) -> str:
    """The run's state once it is done or stopped ('' before)."""
    state = chain.run_state(root)
    return state if state in (chain.DONE, chain.STOPPED) else ""


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The summary of SMALL run without interruption (shared by the tests that resume)."""
    folder = tmp_path_factory.mktemp("reference")
    plain = run_launcher([*SMALL, "recovery=off", f"hydra.run.dir={folder / 'run'}"],
                         cwd=folder, timeout=RUN_ENDS_S)  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-2000:]
    return read_summary(folder / "run")


def test_a_killed_rank_of_a_detached_run_is_resumed_to_the_uninterrupted_loss(tmp_path, request):
    """Rank 1 is killed after step 5 of attempt 1 (its newest checkpoint: step 4); attempt 2
    resumes from step 4 and ends with the loss of a run that was never interrupted. Its
    curves are one series over both attempts (TensorBoard, W&B offline), and ``jobs logs
    --failed`` prints the killed rank's log."""
    root = tmp_path / "run"
    launched = run_launcher(
        [*SMALL, *RECOVERY_ON, EVERY_SINK, "wait=false", f"hydra.run.dir={root}"], cwd=tmp_path,
        env={"AXONN_FAULT": "kill@step5:rank1:attempt1", "WANDB_MODE": "offline"}, timeout=120,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    assert f"started {read_record(root)['job_ids'][0]}" in launched.stdout  # returned at once
    uninterrupted = request.getfixturevalue("reference")  # run (once) while the other runs

    assert poll(lambda: ended(root), RUN_ENDS_S, "the run done or stopped") == chain.DONE
    poll(lambda: not rank_pids_under(tmp_path), 60, "no process of the run left")
    attempts = chain.attempts_of(root)
    history = chain.chain_of(root)["attempts"]
    assert len(attempts) == 2, history
    assert [(a["class"], a["action"]) for a in history] == [("rank_killed", "resume")]
    first, second = read_record(attempts[0]), read_record(attempts[1])
    assert (first["status"], first["failure"]) == ("failed", "rank_killed")
    assert first["ended_by"]["rank"] == 1 and first["ended_by"]["signal"] == "SIGKILL"
    assert (second["attempt"], second["status"]) == (2, "completed")
    assert second["job_ids"][0].startswith("local-") and "recovery" in second
    last = read_summary(attempts[-1])
    # from attempt 1's newest complete checkpoint (step 4, or 2 when step 4's save had not
    # finished when the rank died), not from scratch
    assert last["resumed_from"] == checkpointed_step(attempts[0]) in (2, 4)
    assert last["final_loss"] == uninterrupted["final_loss"]
    supervisor = (attempts[0] / "axonn_launch.log").read_text()  # a detached job's console
    assert f"supervisor: resubmitted {first['job_ids'][0]} (rank_killed)" in supervisor
    assert read_record(root)["chain"]["state"] == chain.DONE  # said by the last supervisor
    # the run's dir alone (what the launcher's next: line names) shows its newest attempt
    alone = [sys.executable, "-m", "axonn_launch.jobs", "status", str(root), "--json"]
    (run,) = json.loads(subprocess.run(alone, capture_output=True, text=True, timeout=120).stdout)
    assert Path(run["job_dir"]).resolve() == attempts[1].resolve(), run
    assert (run["state"], run["attempt"], run["attempts"]) == ("COMPLETED", 2, 2), run
    rows = subprocess.run([sys.executable, "-m", "axonn_launch.jobs", "status", str(root),
                           str(attempts[1]), "--json"], capture_output=True, text=True,
                          timeout=120).stdout  # fmt: skip
    (run,) = json.loads(rows)
    found = run["goodput"]  # local: from the launch to the supervisor's end, per attempt
    assert sum(found[f"{p}_s"] for p in PARTS) == pytest.approx(found["allocated_s"]), found
    assert found["useful_s"] > 0 and found["recovery_s"] > 0 and len(found["ttr_s"]) == 1, found
    # jobs status put the ended run's goodput beside its curves, at its last step
    assert tb_series(root / "tensorboard", "goodput/goodput") == [(8, as_float32(found["goodput"]))]
    assert tb_series(root / "tensorboard", "goodput/recovery_s") == [
        (8, as_float32(found["recovery_s"]))
    ]
    assert found["node_hours"] == pytest.approx(found["allocated_s"] / 3600)  # one node
    check_one_series(root, attempts, resumed=last["resumed_from"])
    failed = subprocess.run([sys.executable, "-m", "axonn_launch.jobs", "logs", str(root),
                             "--failed"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert failed.stdout.startswith("rank 1 failed first\n"), failed.stdout + failed.stderr
    assert "injecting kill after step 5 on rank 1" in failed.stdout
    assert " rank 0 " not in failed.stdout  # rank 0's own log is not shown


def check_one_series(root: Path, attempts: list[Path], resumed: int) -> None:
    """Both attempts' curves in the root's folders: TensorBoard reads one loss per step,
    1..8, the resumed attempt's values (its metrics.jsonl, seeded with attempt 1's rows up
    to the checkpoint) and the attempt marked where each began; W&B offline has one run id
    (one folder per attempt: wandb writes one per ``init``) and every step once."""
    losses = jsonl_losses(attempts[-1])
    shown = tb_series(root / "tensorboard", "loss")
    assert shown == [(step, as_float32(losses[step])) for step in range(1, 9)]
    assert tb_series(root / "tensorboard", "attempt") == [(1, 1.0), (resumed + 1, 2.0)]
    assert not (attempts[-1] / "tensorboard").exists()
    run_id = json.loads((root / "tracker.json").read_text())["wandb_id"]
    folders = sorted((root / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(f"-{run_id}") for f in folders), folders
    rows = [row for folder in folders for row in wandb_history(folder)]
    assert sorted(row["_step"] for row in rows) == list(range(1, 9)), rows
    assert {row["_step"]: row["loss"] for row in rows} == losses
    assert {row["_step"]: row["attempt"] for row in rows} == {
        step: 1 if step <= resumed else 2 for step in range(1, 9)
    }


STEP_DEADLINE_S = 4  # the watchdog's, once start-up is over
WATCHDOG = [f"train.watchdog.step_floor_s={STEP_DEADLINE_S}", "train.watchdog.step_factor=3",
            "train.watchdog.beat_s=0.5"]  # fmt: skip


def test_a_stopped_rank_of_a_local_run_is_a_hang_and_the_run_resumes_exactly(tmp_path, request):
    """Steps take 1 s from step 3 of attempt 1; rank 1 gets a real SIGSTOP after step 4.
    Rank 0's watchdog names it within the deadline (4 s) and a few beats, the supervisor
    ends the stopped rank, and attempt 2 resumes to the uninterrupted loss."""
    root = tmp_path / "run"
    launched = run_launcher(
        [*SMALL, *RECOVERY_ON, *WATCHDOG, "wait=false", f"hydra.run.dir={root}"], cwd=tmp_path,
        env={"AXONN_FAULT": "slow@step3:1:attempt1"}, timeout=120,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    uninterrupted = request.getfixturevalue("reference")
    metrics = root / "metrics.jsonl"
    poll(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 4, 120, "step 4")
    os.kill(read_record(root)["rank_pids"][1], signal.SIGSTOP)
    stopped_at = time.time()
    assert poll(lambda: ended(root), RUN_ENDS_S, "the run done or stopped") == chain.DONE
    (failed,) = chain.chain_of(root)["attempts"]
    assert failed["class"] == "hang", failed
    (record,) = [
        json.loads(p.read_text()) for p in (root / "logs" / "failures").glob("rank_*.json")
    ]
    assert record["time"] - stopped_at <= STEP_DEADLINE_S + 60, record
    assert [s["rank"] for s in record["suspects"]] == [1] and record["rank"] == 0
    assert "Thread" in (root / "logs" / "stacks" / "rank_0.txt").read_text()
    each = [sys.executable, "-m", "axonn_launch.jobs", "status", "--attempts", str(root)]
    shown = subprocess.run(each, capture_output=True, text=True, timeout=120).stdout
    assert "hang" in shown and "rank 1" in shown, shown  # attempt 1's row
    last = read_summary(chain.attempts_of(root)[-1])
    assert last["final_loss"] == uninterrupted["final_loss"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_code_error_of_a_waited_run_stops_it_after_one_attempt(tmp_path, rank):
    """On rank 0 too, whose traceback goes to the terminal (and its failure record), not to
    a log: its peer's lost connection must not make it a collective failure."""
    root = tmp_path / "run"
    result = run_launcher(
        [*SMALL, *RECOVERY_ON, f"hydra.run.dir={root}"], cwd=tmp_path,
        env={"AXONN_FAULT": f"code@step3:rank{rank}"}, timeout=RUN_ENDS_S,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert chain.attempts_of(root) == [root]
    assert not (tmp_path / "run_attempt2").exists()
    run = chain.chain_of(root)
    assert run["state"] == chain.STOPPED
    assert run["stop"] == {"reason": "code_error: policy stop", "class": "code_error",
                           "attempt": 1}  # fmt: skip
    assert f"supervisor: {root}: stop: code_error: policy stop" in result.stderr
    assert result.stdout.splitlines()[-2] == "recovery: stopped"


def test_sigterm_to_a_launcher_following_its_run_stops_the_run_not_resumed(tmp_path):
    """Attempt 1 loses rank 1 and is resumed; attempt 2 sleeps after step 5. A SIGTERM to
    the waiting launcher reaches attempt 2's supervisor, which stops its ranks and the run:
    a job stopped by a person is never resumed, even with a policy that would resume it."""
    root = tmp_path / "run"
    out, err = tmp_path / "console.out", tmp_path / "console.err"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["AXONN_FAULT"] = "kill@step3:rank1:attempt1,pause@step5:300:attempt2"
    argv = [*SMALL, *RECOVERY_ON, "recovery.policy.cancelled=resume", f"hydra.run.dir={root}"]
    with open(out, "w") as stdout, open(err, "w") as stderr:
        launcher = subprocess.Popen([sys.executable, "-m", "axonn_launch", *argv], cwd=tmp_path,
                                    env=env, stdout=stdout, stderr=stderr)  # fmt: skip
        try:
            second = tmp_path / "run_attempt2"
            paused = second / "logs" / "rank_1.log"
            poll(lambda: paused.exists() and "injecting pause" in paused.read_text(),
                 RUN_ENDS_S, "attempt 2 sleeping after step 5")  # fmt: skip
            launcher.send_signal(signal.SIGTERM)
            code = launcher.wait(timeout=60)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    assert code == 1, err.read_text()[-2000:]
    assert chain.attempts_of(root) == [root, second]
    run = chain.chain_of(root)
    assert run["state"] == chain.STOPPED
    assert run["stop"] == {"reason": "SIGTERM: the job was stopped", "class": "cancelled"}
    final = read_record(second)
    assert (final["status"], final["failure"]) == ("failed", "cancelled")
    assert final["ended_by"]["signal"] == "SIGTERM"
    assert not (tmp_path / "run_attempt3").exists()
    assert "recovery: stopped" in out.read_text()
    poll(lambda: not rank_pids_under(tmp_path), 30, "no process of the run left")
    rows = [json.loads(x) for x in (second / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 4  # the pause came before step 5's row


def test_jobs_stop_ends_a_running_local_run(tmp_path):
    """``jobs stop`` on a detached local run mid-training: its supervisor gets SIGTERM,
    stops the ranks, and nothing is resumed."""
    root = tmp_path / "run"
    launched = run_launcher(
        [*SMALL, *RECOVERY_ON, "wait=false", f"hydra.run.dir={root}"], cwd=tmp_path,
        env={"AXONN_FAULT": "pause@step3:300"}, timeout=120,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-2000:]
    paused = root / "logs" / "rank_1.log"  # rank 0's own lines go to the job's console
    poll(lambda: paused.exists() and "injecting pause" in paused.read_text(), RUN_ENDS_S,
         "the run sleeping after step 3")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "AXONN_FAULT"}
    stopped = subprocess.run([sys.executable, "-m", "axonn_launch.jobs", "stop", str(root)],
                             capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    job_id = read_record(root)["job_ids"][0]
    assert stopped.returncode == 0 and f"cancelled {job_id}" in stopped.stdout, stopped
    poll(lambda: not rank_pids_under(tmp_path), 30, "no process of the run left")
    record = read_record(root)
    assert (record["status"], record["failure"]) == ("failed", "cancelled")
    assert chain.run_state(root) == chain.STOPPED
    assert chain.attempts_of(root) == [root] and not (tmp_path / "run_attempt2").exists()


def test_ctrl_c_on_a_local_run_saves_then_stops_and_resubmit_resumes_it_exactly(tmp_path, request):
    """No periodic checkpoint (``checkpoint_every=0``, the default); steps take 1 s from
    step 2 of attempt 1. A Ctrl-C (SIGINT to the launcher's process group, as a terminal
    sends it) once step k is logged: the ranks save at the next step boundary (k or k+1)
    and stop; the launcher exits 130 naming the resume, job.json says the user stopped it,
    and ``jobs resubmit`` resumes from that step to the loss of a run never interrupted."""
    root = tmp_path / "run"
    small = [a for a in SMALL if not a.startswith("train.checkpoint_every=")]
    argv = [*small, "train.checkpoint_every=0", "recovery=off", f"hydra.run.dir={root}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env |= {"AXONN_FAULT": "slow@step2:1:attempt1", "PYTHONPATH": str(REPO)}
    out, err = tmp_path / "console.out", tmp_path / "console.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        launcher = subprocess.Popen([sys.executable, "-m", "axonn_launch", *argv], cwd=tmp_path,
                                    env=env, stdout=stdout, stderr=stderr,
                                    start_new_session=True)  # fmt: skip
        try:
            metrics = root / "metrics.jsonl"
            poll(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 120,
                 "step 3 logged")  # fmt: skip
            k = len(metrics.read_text().splitlines())
            os.killpg(launcher.pid, signal.SIGINT)
            code = launcher.wait(timeout=60)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    assert code == 130, err.read_text()[-2000:]
    record = read_record(root)
    saved = checkpointed_step(root)
    assert k <= saved < 8 and record["ended_by"]["saved_step"] == saved, (k, record)
    assert record["ended_by"]["by_user"] and record["ended_by"]["signal"] == "SIGINT"
    assert (record["status"], record["failure"]) == ("failed", "cancelled")
    said = [ln for ln in err.read_text().splitlines() if ln.startswith("supervisor: SIGINT")]
    assert said[0] == ("supervisor: SIGINT: saving a checkpoint at the next step boundary,"
                       " then stopping (Ctrl-C again stops at once)"), said  # fmt: skip
    last = out.read_text().splitlines()[-1]
    assert last.endswith(f"-m axonn_launch.jobs resubmit ./run  (resumes from step {saved})")
    plain = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "AXONN_FAULT")}
    shown = run_module("axonn_launch.jobs", ["status", str(root)], cwd=tmp_path, env=plain).stdout
    assert f"stopped by the user after step {saved}" in shown, shown

    resumed = run_module("axonn_launch.jobs", ["resubmit", str(root), "wait=true"], cwd=tmp_path,
                         env=plain, timeout=RUN_ENDS_S)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    (second,) = chain.attempts_of(root)[1:]
    last_summary = read_summary(second)
    assert last_summary["resumed_from"] == saved and last_summary["steps"] == 8
    assert last_summary["final_loss"] == request.getfixturevalue("reference")["final_loss"]
