"""A newcomer's first hour, through the command line as a user types it: each
mistake ends with one exact line and exit code 2, the planner explains itself, and nothing
ends in a traceback unless asked for (``--debug``, ``HYDRA_FULL_ERROR=1``).

The refused ``sbatch`` runs against the real cluster: tests/slurm/test_first_hour_slurm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from axonn_launch.train.inference.generation import decode
from tests.cost.test_perf import check_calibration_feeds_the_planner

JOB_DIR_HINT = (
    "a job dir is the folder one launch writes, holding job.json"
    " (python -m axonn_launch makes jobs/<name>/<time>/)"
)
# variables that would make calibrate join a world instead of finding none
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def run(module: str, *args: str, cwd: Path, env: dict | None = None):
    full = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", *RANK_VARIABLES)}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_error_line(proc) -> str:
    """The single stderr line of a user error (and no traceback anywhere)."""
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


# --- jobs on something that is not a job ---------------------------------------------------


@pytest.mark.parametrize(
    "command,target,what",
    [
        ("resubmit", "package", "holds no job dir"),
        ("resubmit", "empty", "holds no job dir"),
        ("resubmit", "missing", "no such file or directory"),
        ("status", "missing", "no such file or directory"),
        ("status", "empty", "holds no job dir"),
    ],
)
def test_jobs_on_a_path_without_jobs_is_one_line_and_exit_2(tmp_path, command, target, what):
    (tmp_path / "empty").mkdir()
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "__init__.py").write_text("")
    path = {"package": "package", "empty": "empty", "missing": "/does/not/exist"}[target]
    proc = run("axonn_launch.jobs", command, path, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_error_line(proc) == f"error: {path}: {what}; {JOB_DIR_HINT}"


def test_jobs_debug_shows_the_traceback(tmp_path):
    proc = run("axonn_launch.jobs", "status", "/does/not/exist", "--debug", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "NotAJobPath" in proc.stderr


# --- every command has --help --------------------------------------------------------------
# (tests/commands/test_cli_help.py)

# --- bad input that ended in a traceback: one line instead ---------------------------------


def test_plan_with_a_missing_calibration_file(tmp_path):
    proc = run("axonn_launch.plan", "calibration=nofile.json", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_error_line(proc) == (
        "error: calibration='nofile.json': no such file; write one with"
        " python -m axonn_launch.calibrate (it prints the file's path)"
    )
    debug = run("axonn_launch.plan", "calibration=nofile.json", "--debug", cwd=tmp_path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    full = run("axonn_launch.plan", "calibration=nofile.json", cwd=tmp_path,
               env={"HYDRA_FULL_ERROR": "1"})  # fmt: skip
    assert full.returncode != 0 and "Traceback" in full.stderr


def test_plan_with_a_file_that_is_not_a_calibration(tmp_path):
    (tmp_path / "cal.json").write_text("{")
    proc = run("axonn_launch.plan", "calibration=cal.json", cwd=tmp_path)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert line.startswith("error: calibration='cal.json': not a calibration file (")


def test_calibrate_on_a_cluster_machine_outside_an_allocation(tmp_path):
    proc = run("axonn_launch.calibrate", "machine=perlmutter", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_error_line(proc) == (
        "error: calibrate machine=perlmutter: needs a GPU allocation (no srun task here); run it"
        " inside salloc with srun, one task per GPU, or use machine=local nproc=4"
    )
    assert list(tmp_path.iterdir()) == []


def test_calibrate_outside_an_allocation_says_so_before_importing_torch(tmp_path):
    """The login node hears it at once: torch (seconds to import there) is never loaded."""
    probe = (
        "import sys; from axonn_launch.calibrate import main; "
        "code = main(['machine=perlmutter']); print(code, 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert "needs a GPU allocation" in proc.stderr


def test_calibrate_in_a_task_without_nccl(tmp_path):
    """Inside an srun task on a computer whose torch has no NCCL or no GPU."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = run("axonn_launch.calibrate", "machine=perlmutter", cwd=tmp_path, env=env)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert line.startswith("error: calibrate machine=perlmutter: backend nccl is not available")
    assert line.endswith("run it inside salloc with srun, one task per GPU, or use machine=local"
                         " nproc=4")  # fmt: skip


def test_calibrate_bad_key_is_one_line(tmp_path):
    proc = run("axonn_launch.calibrate", "colour=red", cwd=tmp_path)
    assert proc.returncode == 2
    assert one_error_line(proc) == (
        "error: 'colour=red': expected key=value with key in machine, output, nproc, small_bytes,"
        " large_bytes, reps, warmup, block_seconds, gpus_per_node, model, nodes, global_batch,"
        " gemm_grids (python -m axonn_launch.calibrate --help)"
    )


# --- guidance on node counts ---------------------------------------------------------------


def test_plan_without_nodes_plans_for_the_fewest_that_fit(tmp_path):
    proc = run("axonn_launch.plan", "machine=frontier", "model=gpt_320b", "top=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "nodes not given: planning for nodes=16, the fewest where a grid fits"
    assert lines[1].startswith("gpt_320b on 16 node(s) of frontier = 128 GPUs")
    launcher = run("axonn_launch", "machine=frontier", "model=gpt_320b", "dry_run=true",
                   cwd=tmp_path)  # fmt: skip
    assert "nodes      16 x 8 tasks" in launcher.stdout  # the same search


def test_plan_on_too_few_nodes_names_the_constraint_and_the_minimum(tmp_path):
    proc = run("axonn_launch.plan", "machine=frontier", "model=gpt_320b", "nodes=1", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr == ""
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(
        "no grid of 1 node(s) of frontier can run gpt_320b: all 20 grids rejected:"
        " 20 do not fit in memory (e.g. "
    )
    assert last.endswith("; the fewest nodes where a grid fits: nodes=16")
    payload = json.loads(
        run(
            "axonn_launch.plan",
            "machine=frontier",
            "model=gpt_320b",
            "nodes=1",
            "output=json",
            cwd=tmp_path,
        ).stdout  # fmt: skip
    )
    assert payload["plans"] == [] and payload["why_none"] == last


def test_launcher_on_too_few_nodes_gives_the_reason_and_the_minimum(tmp_path):
    proc = run("axonn_launch", "machine=frontier", "model=gpt_320b", "nodes=1", "dry_run=true",
               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert line.startswith(
        "error: grid=auto: no grid of 1 node(s) of frontier can run gpt_320b: all 20 grids"
        " rejected: 20 do not fit in memory (e.g. "
    )
    assert line.endswith("; the fewest nodes where a grid fits: nodes=16")
    assert list(tmp_path.iterdir()) == []


# --- contradictions and surprises ----------------------------------------------------------


def test_the_planner_keeps_x_inside_a_node(tmp_path):
    proc = run("axonn_launch.plan", "machine=frontier", "model=gpt_320b", "nodes=16", "top=50",
               "output=json", cwd=tmp_path)  # fmt: skip
    payload = json.loads(proc.stdout)
    assert payload["plans"] and all(8 % p["grid"]["x"] == 0 for p in payload["plans"])
    assert payload["rejected"]["placement"] == 20  # the grids with x = 16, 32, 64 or 128


def test_a_big_model_on_the_builtin_corpus_warns(tmp_path):
    proc = run(
        "axonn_launch",
        "machine=frontier",
        "model=gpt_320b",
        "dry_run=true",
        "site.accounts.frontier=CSC123",
        "train.steps=50",  # fits its allocations
        "train.warmup_steps=5",
        cwd=tmp_path,
    )  # fmt: skip (warm-up: its own warning)
    assert proc.returncode == 0
    assert proc.stderr.splitlines() == [
        "warning: model=gpt_320b (323.0 B parameters) on train.data=shakespeare, the built-in"
        " 1 MB corpus: fine for a smoke test, not for training; pass"
        " train.data=<path to a .bin token file>"
    ]


README_PERLMUTTER = [
    "machine=perlmutter", "model=gpt_20b", "grid.x=4", "grid.z=16", "grid.data=2",
    "site.accounts.perlmutter=m1234_g", "train.data=/pscratch/tokens.bin",
]  # fmt: skip


def test_a_dry_run_warns_about_a_data_path_that_is_not_here(tmp_path):
    proc = run("axonn_launch", *README_PERLMUTTER, "dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "warning: train.data='/pscratch/tokens.bin': no such file here; valid: shakespeare,"
        " synthetic, or a path to a .bin token file (a real submission checks it again)"
    ]


def test_a_real_submission_still_checks_the_data_path(tmp_path, fake_sbatch):
    bindir, marker = fake_sbatch
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    work = tmp_path / "cwd"
    work.mkdir()
    proc = run("axonn_launch", *README_PERLMUTTER, cwd=work, env=env)
    assert proc.returncode == 2 and not marker.exists()
    assert one_error_line(proc) == (
        "error: train.data='/pscratch/tokens.bin': no such file here; valid: shakespeare,"
        " synthetic, or a path to a .bin token file"
    )
    assert list(work.iterdir()) == []


# --- progress, samples and calibrate's phases ----------------------------------------------


@pytest.mark.slow
def test_a_job_whose_output_is_no_terminal_prints_progress_lines(tmp_path):
    """As in a Slurm log: lines with step, loss, tokens/s and an ETA while it trains."""
    proc = run("axonn_launch", "train.steps=4", "train.log_every_s=0", "train.sample_tokens=0",
               "hydra.run.dir=jobs/progress", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line.split("axonn_launch.train.metrics: ", 1)[1]
             for line in proc.stdout.splitlines() if "metrics: step " in line]  # fmt: skip
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"], proc.stdout
    assert all(" tok/s " in line and " s/step " in line and ", eta " in line for line in lines)
    assert "\r" not in proc.stdout + proc.stderr


def test_samples_show_invalid_bytes_and_control_codes_escaped():
    tokens = list(b"To be\xe2\x80 or\n\x1b[31mnot\tto be ") + list("é".encode())
    assert decode(tokens, "shakespeare") == "To be\\xe2\\x80 or\n\\x1b[31mnot\tto be é"


@pytest.mark.slow
def test_calibrate_reports_its_phases_and_writes_into_its_job_dir(tmp_path):
    quick = ["reps=1", "warmup=1", "small_bytes=1024", "large_bytes=65536", "block_seconds=0.005"]
    proc = run("axonn_launch.calibrate", "machine=local", "nproc=2", *quick, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    phases = [line.split("] ", 1)[1] for line in proc.stdout.splitlines() if "calibrate [" in line]
    assert phases == [
        "2 ranks (gloo, cpu), 1 group layouts",
        "collectives 1/1: groups of 2, 2 per node (all-reduce, all-gather, reduce-scatter)",
        "GEMM throughput",
        "element-wise (memory) throughput",
        "overlap of an all-reduce with GEMMs",
    ]
    (written,) = (tmp_path / "jobs").glob("calibrate-local/*/calibration-local.json")
    assert f"written to {written.relative_to(tmp_path)}" in proc.stdout
    check_calibration_feeds_the_planner(written)  # the planner reads it (one run for both)
    # out=FILE is only where run_local writes: parsed here, not a second 2-rank run (about
    # half this test's time); a run writing to its output= file is, under srun,
    # tests/slurm/test_cluster.py::start_calibrate
    from axonn_launch.calibrate import parse_args

    out = tmp_path / "mine" / "cal.json"
    assert parse_args(["machine=local", f"out={out}"]).output_path() == out


# --- a job's state is its own result -------------------------------------------------------


@pytest.mark.slow
def test_a_resubmitted_local_job_that_finished_shows_as_completed(tmp_path):
    """A local job fails (an injected collective error), is resubmitted; the
    new attempt, which nobody waits for, runs to its end: status reads its summary.json,
    job.json says completed, and a second resubmit has nothing to do."""
    # no sample at attempt 2's end (7 of the test's 22 CPU-s); the sample: test_first_day_console
    steps = ["train.steps=4", "train.warmup_steps=0", "train.checkpoint_every=2",
             "train.sample_tokens=0"]  # fmt: skip
    first = run("axonn_launch", *steps, "hydra.run.dir=jobs/first", cwd=tmp_path,
                env={"AXONN_FAULT": "collective@step3"})  # fmt: skip
    assert first.returncode == 1, first.stderr[-2000:]
    first_id = json.loads((tmp_path / "jobs" / "first" / "job.json").read_text())["job_ids"][0]
    again = run("axonn_launch.jobs", "resubmit", "jobs/first", cwd=tmp_path)
    assert again.returncode == 0 and "resubmitted local-" in again.stdout, again.stdout
    attempt = tmp_path / "jobs" / "first_attempt2"
    record = json.loads((attempt / "job.json").read_text())
    pid = int(record["job_ids"][0].split("-")[1])
    deadline = time.monotonic() + 240
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(1)
    # unwaited, yet final: the attempt's supervisor wrote its end
    assert json.loads((attempt / "job.json").read_text())["status"] == "completed"
    status = run("axonn_launch.jobs", "status", "--json", "jobs", cwd=tmp_path)
    rows = {Path(r["job_dir"]).name: r for r in json.loads(status.stdout)}
    assert (rows["first_attempt2"]["state"], rows["first_attempt2"]["failure"]) == (
        "COMPLETED",
        "completed",
    )
    assert rows["first_attempt2"]["step"] == 4
    assert json.loads((attempt / "job.json").read_text())["status"] == "completed"
    second = run("axonn_launch.jobs", "resubmit", "jobs", cwd=tmp_path)
    assert second.returncode == 0
    assert second.stdout.splitlines() == [
        f"skip  {first_id} jobs/first: already resubmitted as jobs/first_attempt2",
        f"skip  {record['job_ids'][0]} jobs/first_attempt2: completed: nothing to do",
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
